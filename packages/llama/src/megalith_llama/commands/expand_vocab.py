"""`expand-vocab`: add tokens to a BPE or SentencePiece tokenizer and resize the model."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

HELP = "add new tokens to a tokenizer (BPE tokenizer.json or SentencePiece .model) and resize the model"


def register(sub: argparse._SubParsersAction, parent: argparse.ArgumentParser) -> None:
    p = sub.add_parser("expand-vocab", parents=[parent], help=HELP, description=HELP)
    p.add_argument(
        "--new-tokens", required=True,
        help="file with one token per line; a leading '\u2581' (or space) marks a word-initial token",
    )  # fmt: skip
    p.add_argument("--output", required=True, help="output directory (tokenizer files + resized model)")
    p.add_argument(
        "--tokenizer", default=None,
        help="tokenizer.json, .model, or a directory holding one (default: the converted SmolLM2 directory)",
    )  # fmt: skip
    p.add_argument(
        "--model", default=None,
        help="model to resize: HF directory, .gguf or 'smollm2' (default: the tokenizer's directory when it "
        "holds a model)",
    )  # fmt: skip
    p.add_argument("--tokenizer-only", action="store_true", help="do not touch any model")
    p.add_argument(
        "--text", default=None, help="text file to measure chars/token on (default: built-in held-out)"
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    p.set_defaults(func=run)


def _measure_text(path: str | None) -> str:
    if path:
        from megalith.common.errors import ConfigError

        text = Path(path)
        if not text.is_file():
            raise ConfigError(f"--text {path}: no such file")
        return text.read_text(encoding="utf-8")
    from megalith_llama.corpus import builtin_documents

    return "\n\n".join(d.text for d in builtin_documents("heldout"))


def run(args: argparse.Namespace) -> int:
    from megalith_llama.expand import expand_vocabulary
    from megalith_llama.io import check_output_free
    from megalith_llama.model import default_model_dir, load_model
    from megalith_llama.tokenizer import read_new_tokens

    check_output_free(args.output, args.overwrite)  # bad output or --text fail before any work
    tokens = read_new_tokens(args.new_tokens)
    text = _measure_text(args.text)
    tok_path = Path(args.tokenizer) if args.tokenizer else default_model_dir(args.data_dir)
    model_source = args.model
    if model_source is None and tok_path.is_dir() and (tok_path / "config.json").is_file():
        model_source = str(tok_path)
    model = None
    if model_source is not None and not args.tokenizer_only:
        model = load_model(model_source, data_dir=args.data_dir).model
    report = expand_vocabulary(tok_path, tokens, args.output, model, text, args.overwrite)
    print(json.dumps(vars(report), indent=2, ensure_ascii=False))
    return 0
