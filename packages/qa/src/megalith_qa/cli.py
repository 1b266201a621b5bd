"""`qa-serve`: start the server (default), `qa-serve ingest PATH...`, `qa-serve eval`.

Data directory (Chroma database, converted model cache, evaluation output): `--data-dir`, else the
environment variable MEGALITH_DATA_DIR, else ~/.cache/megalith/qa.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import platform
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from megalith.common.errors import ConfigError, MegalithError
from megalith.common.logging import configure_logging
from megalith_qa import __version__
from megalith_qa.config import QAConfig, ServerConfig, resolve_data_dir
from megalith_qa.embedding import parse_embedder
from megalith_qa.pipeline import build_pipeline

logger = logging.getLogger(__name__)
COMMANDS = ("serve", "ingest", "eval")
DESCRIPTION = (
    "Retrieval-augmented QA over a local knowledge base (Python's documentation topics, this project's "
    "READMEs, and files you add). Commands: serve (default), ingest PATH..., eval. Data directory: "
    "--data-dir, else $MEGALITH_DATA_DIR, else ~/.cache/megalith/qa."
)
EPILOG = """\
`qa-serve` with no command, or with only options, runs `serve`. The server's options
(--host, --port, --api-key, --llm, --max-upload-mb, --max-new-tokens, --no-repeat-ngram,
--no-builtin, --data-dir,
--chroma-url, --embedder, --log-level) are listed by:

  qa-serve serve --help

and the other commands' by `qa-serve ingest --help` and `qa-serve eval --help`."""
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def positive_float(value: str) -> float:
    """argparse type: a finite number > 0 (rejects nan, inf, 0, negatives)."""
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    if not math.isfinite(number) or number <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {value!r}")
    return number


def int_in(low: int, high: int | None, what: str) -> Callable[[str], int]:
    """argparse type: an integer in `low..high` (no upper bound if `high` is None); the error says
    "must be {what}" and names the value."""

    def parse(value: str) -> int:
        try:
            number = int(value)
        except ValueError:
            number = None
        if number is None or number < low or (high is not None and number > high):
            raise argparse.ArgumentTypeError(f"must be {what}, got {value!r}")
        return number

    return parse


positive_int = int_in(1, None, "an integer >= 1")
port_number = int_in(0, 65535, "a port number in 0..65535")  # 0 lets the system pick one


def embedder_kind(value: str) -> str:
    """argparse type: 'minilm', 'hashing' or 'hashing-<dim>' (checked without loading anything)."""
    try:
        parse_embedder(value)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
    return value


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--data-dir",
        default=None,
        help="where the Chroma database and caches live (default: $MEGALITH_DATA_DIR or ~/.cache/megalith/qa)",
    )
    parser.add_argument(
        "--chroma-url",
        default=None,
        help="use a Chroma server (e.g. http://127.0.0.1:8001 started by `chroma run`) instead of the embedded database",
    )
    parser.add_argument(
        "--embedder",
        default="minilm",
        type=embedder_kind,
        help="embedding model: 'minilm' (all-MiniLM-L6-v2, default) or 'hashing[-DIM]' (fast feature hashing, for tests)",
    )
    parser.add_argument(
        "--log-level",
        default="INFO",
        type=str.upper,
        choices=LOG_LEVELS,
        help="logging level: DEBUG, INFO (default), WARNING, ERROR or CRITICAL",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="qa-serve",
        description=textwrap.fill(DESCRIPTION, width=100),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"megalith-qa {__version__}")
    sub = parser.add_subparsers(dest="command")
    serve = sub.add_parser(
        "serve", help="start the HTTP server (the default command)", description=DESCRIPTION
    )
    _common(serve)
    serve.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; others need --api-key)"
    )
    serve.add_argument("--port", type=port_number, default=8000, help="port to bind (default 8000)")
    serve.add_argument(
        "--api-key",
        default=os.environ.get("MEGALITH_QA_API_KEY") or None,  # an empty variable counts as unset
        help="require 'Authorization: Bearer KEY' on every endpoint but /healthz (env MEGALITH_QA_API_KEY; "
        "an empty key or one with outer spaces is refused)",
    )
    serve.add_argument(
        "--llm",
        choices=("smollm2", "extractive"),
        default="smollm2",
        help="answer generator: SmolLM2-135M-Instruct (default) or extractive (best-matching sentences; fast)",
    )
    serve.add_argument(
        "--max-upload-mb",
        type=positive_float,
        default=10.0,
        help="largest accepted upload in MiB (default 10)",
    )
    serve.add_argument(
        "--max-new-tokens",
        type=positive_int,
        default=128,
        help="default answer length limit in tokens, >= 1 (default 128; a request's max_tokens overrides it)",
    )
    serve.add_argument(
        "--no-repeat-ngram",
        type=int,
        default=6,
        metavar="N",
        help="SmolLM2 never repeats an N-token sequence of its own answer (quoting the passages stays "
        "allowed); stops greedy decoding's loops (default 6; 0 turns it off)",
    )
    serve.add_argument(
        "--no-builtin", action="store_true", help="do not ingest the built-in knowledge base at start"
    )
    ingest = sub.add_parser("ingest", help="add files or folders to the knowledge base")
    _common(ingest)
    ingest.add_argument(
        "paths", nargs="+", help="files (txt, md, html, pdf, csv, json, jsonl) or folders to ingest"
    )
    ingest.add_argument(
        "--skip-bad",
        action="store_true",
        help="leave out files that cannot be read (not UTF-8, malformed, no text), listing each with its "
        "reason, and ingest the rest (default: such a file stops the command before anything is stored)",
    )
    ev = sub.add_parser("eval", help="hit@1/5/10, MRR and nDCG@10 of dense, BM25 and hybrid retrieval")
    _common(ev)
    ev.add_argument(
        "--eval-set", default=None, help="JSON-lines question set (default: the one shipped with the package)"
    )
    ev.add_argument(
        "--out",
        default=None,
        help="JSON results file, written atomically (default DATA_DIR/eval.json); must not be a directory",
    )
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or (args[0] not in COMMANDS and args[0] not in ("-h", "--help", "--version")):
        args = ["serve", *args]
    return build_parser().parse_args(args)


def make_config(ns: argparse.Namespace, llm: str = "extractive") -> QAConfig:
    mib = getattr(ns, "max_upload_mb", 10.0)
    max_upload_bytes = int(mib * 1024 * 1024)
    if max_upload_bytes < 1:
        raise ConfigError(f"--max-upload-mb {mib!r} is less than one byte")
    server = ServerConfig(
        host=getattr(ns, "host", "127.0.0.1"),
        port=getattr(ns, "port", 8000),
        api_key=getattr(ns, "api_key", None),
        max_upload_bytes=max_upload_bytes,
        max_new_tokens=getattr(ns, "max_new_tokens", 128),
        no_repeat_ngram=getattr(ns, "no_repeat_ngram", 6),
    )
    return QAConfig(
        data_dir=resolve_data_dir(ns.data_dir),
        chroma_url=ns.chroma_url,
        llm=getattr(ns, "llm", llm),
        server=server,
    )


def cmd_ingest(ns: argparse.Namespace) -> int:
    from megalith_qa.knowledge import BadFileError, expand_sources

    config = make_config(ns)
    files = expand_sources(ns.paths)  # a missing path or a name clash: reported before the embedder loads
    pipeline = build_pipeline(config, ns.embedder)
    try:
        results = pipeline.kb.ingest_files(files, progress=True, skip_bad=ns.skip_bad)
    except BadFileError as exc:
        raise BadFileError(f"{exc}; nothing was ingested (--skip-bad leaves such files out)") from exc
    for r in results:
        if r.status == "skipped":
            print(f"skipped: {r.error}", file=sys.stderr)
        else:
            print(f"{r.status:<9} {r.chunks:>5} chunks  {r.source}  (id {r.doc_id})")
    return 0


def check_output_file(out: Path) -> None:
    """ConfigError unless `out` can be written as a file: not a directory, and no file where a folder is needed."""
    if out.is_dir():
        raise ConfigError(
            f"--out {str(out)!r} is a directory; give a file path such as {str(out / 'eval.json')!r}"
        )
    for parent in out.parents:
        if parent.exists():
            if not parent.is_dir():
                raise ConfigError(f"--out {str(out)!r}: {str(parent)!r} is a file, not a directory")
            return


def cmd_eval(ns: argparse.Namespace) -> int:
    from megalith_qa.evaluation import evaluate, format_table, load_eval_set, to_json, write_json

    config = make_config(ns)
    out = Path(ns.out) if ns.out else config.data_dir / "eval.json"
    check_output_file(out)  # both checks come before the (minutes long) ingestion and evaluation
    items = load_eval_set(Path(ns.eval_set) if ns.eval_set else None)
    pipeline = build_pipeline(config, ns.embedder)
    pipeline.ingest_builtin(progress=True)
    scores = evaluate(pipeline.retriever, items, progress=True)
    print(format_table(scores))
    extra = {
        "embedder": pipeline.kb.embedder.name,
        "chunks": pipeline.kb.store.count(),
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"),
    }
    write_json(out, to_json(scores, extra))
    print(f"wrote {out}")
    return 0


def cmd_serve(ns: argparse.Namespace) -> int:
    import uvicorn

    from megalith_qa.server import create_app

    start = time.perf_counter()
    config = make_config(ns)
    pipeline = build_pipeline(config, ns.embedder)
    if not ns.no_builtin:
        pipeline.ingest_builtin(progress=True)
    load = getattr(pipeline.generator, "load", None)
    if load is not None:  # warm the model in the background; the first answer waits for it if needed
        threading.Thread(target=load, name="llm-warmup", daemon=True).start()
    app = create_app(pipeline)
    print(f"megalith-qa ready in {time.perf_counter() - start:.1f}s; data in {config.data_dir}", flush=True)
    print(f"Serving on http://{config.server.host}:{config.server.port}  (API docs at /docs)", flush=True)
    try:  # the app has no lifespan events; uvicorn re-raises Ctrl+C once it has shut down
        uvicorn.run(
            app,
            host=config.server.host,
            port=config.server.port,
            log_level=ns.log_level.lower(),
            lifespan="off",
        )
    except KeyboardInterrupt:
        print("megalith-qa stopped", flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    ns = parse_args(argv)
    configure_logging(getattr(logging, str(ns.log_level).upper(), logging.INFO))
    os.environ.setdefault("ANONYMIZED_TELEMETRY", "False")
    try:
        return {"serve": cmd_serve, "ingest": cmd_ingest, "eval": cmd_eval}[ns.command](ns)
    except MegalithError as exc:
        print(f"qa-serve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
