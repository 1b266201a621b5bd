from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

from megalith.common.errors import ConfigError, DataError
from megalith_qa.cli import build_parser, main, make_config, parse_args
from megalith_qa.config import resolve_data_dir
from megalith_qa.evaluation import hit_at, load_eval_set, ndcg, reciprocal_rank


def test_help_does_not_import_torch() -> None:
    """Building the parser (``--help``) loads no torch: the heavy imports wait for the commands."""
    code = (
        "import sys; from megalith_qa.cli import build_parser; build_parser(); print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_metrics_by_hand() -> None:
    rel = frozenset({"A"})
    ranked = ["B", "C", "A", "A"]
    assert hit_at(ranked, rel, 1) == 0.0 and hit_at(ranked, rel, 3) == 1.0
    assert reciprocal_rank(ranked, rel) == pytest.approx(1 / 3)
    # relevant at ranks 3 and 4, 2 relevant chunks in the index: (1/log2 4 + 1/log2 5) / (1 + 1/log2 3)
    assert ndcg(ranked, rel, n_relevant=2) == pytest.approx((0.5 + 1 / math.log2(5)) / (1 + 1 / math.log2(3)))
    assert ndcg(["B"], rel, n_relevant=0) == 0.0


def test_shipped_eval_set_covers_real_topics() -> None:
    from pydoc_data.topics import topics

    items = load_eval_set()
    assert len(items) >= 80
    assert all(s.removeprefix("pydoc:") in topics for item in items for s in item.relevant)


def test_bad_eval_row_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "set.jsonl"
    path.write_text('{"question": "q", "topic": "if"}\n{"question": "no topic"}\n')
    with pytest.raises(DataError, match=r"set\.jsonl:2"):
        load_eval_set(path)


def test_data_dir_resolution(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("MEGALITH_DATA_DIR", str(tmp_path / "env"))
    assert resolve_data_dir(None) == (tmp_path / "env").resolve()
    assert resolve_data_dir(tmp_path / "flag") == (tmp_path / "flag").resolve()
    monkeypatch.delenv("MEGALITH_DATA_DIR")
    assert resolve_data_dir(None) == Path("~/.cache/megalith/qa").expanduser().resolve()


def test_zero_arg_parses_as_serve_and_help_documents_data_dir(capsys: pytest.CaptureFixture[str]) -> None:
    ns = parse_args([])
    assert ns.command == "serve" and ns.host == "127.0.0.1" and ns.port == 8000 and ns.llm == "smollm2"
    assert parse_args(["--llm", "extractive"]).llm == "extractive"
    help_text = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()  # type: ignore[union-attr]
    assert "MEGALITH_DATA_DIR" in help_text and "--chroma-url" in help_text


def test_non_loopback_host_requires_api_key() -> None:
    with pytest.raises(ConfigError, match="0.0.0.0"):
        make_config(parse_args(["--host", "0.0.0.0"]))
    assert make_config(parse_args(["--host", "0.0.0.0", "--api-key", "k"])).server.api_key == "k"
    assert main(["--host", "10.1.2.3"]) == 2


@pytest.mark.parametrize("key", ["", "   ", " k", "k\n"])
def test_empty_or_padded_api_key_is_refused(key: str, capsys: pytest.CaptureFixture[str]) -> None:
    """An empty key would admit `Authorization: Bearer ` with no token; a padded one could never match."""
    with pytest.raises(ConfigError, match="--api-key is empty or starts or ends with whitespace"):
        make_config(parse_args(["--api-key", key]))
    assert main(["--api-key", key]) == 2
    assert "--api-key is empty" in capsys.readouterr().err


def test_empty_api_key_variable_counts_as_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEGALITH_QA_API_KEY", "")
    assert make_config(parse_args([])).server.api_key is None
    monkeypatch.setenv("MEGALITH_QA_API_KEY", "s3cret")
    assert make_config(parse_args([])).server.api_key == "s3cret"


def test_no_repeat_ngram_flag_reaches_the_config_and_is_checked() -> None:
    assert make_config(parse_args([])).server.no_repeat_ngram == 6
    assert make_config(parse_args(["--no-repeat-ngram", "0"])).server.no_repeat_ngram == 0
    with pytest.raises(ConfigError, match="--no-repeat-ngram must be 0 \\(off\\) or >= 2, got 1"):
        make_config(parse_args(["--no-repeat-ngram", "1"]))
    assert main(["--no-repeat-ngram", "-3"]) == 2


def test_cli_ingest_then_reingest(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = tmp_path / "otters.md"
    doc.write_text("Sea otters hold hands while they sleep.")
    args = ["ingest", str(doc), "--data-dir", str(tmp_path / "d"), "--embedder", "hashing"]
    assert main(args) == 0
    assert "added" in capsys.readouterr().out
    assert main(args) == 0
    assert "unchanged" in capsys.readouterr().out
    assert main(["ingest", str(tmp_path / "missing.txt"), "--data-dir", str(tmp_path / "d")]) == 2


def test_cli_ingest_checks_paths_before_loading_the_embedder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import megalith_qa.cli as cli

    monkeypatch.setattr(cli, "build_pipeline", lambda *a, **k: pytest.fail("the pipeline was built"))
    assert main(["ingest", str(tmp_path / "missing.txt"), "--data-dir", str(tmp_path / "d")]) == 2
    assert "missing.txt" in capsys.readouterr().err


def test_cli_ingest_folder_with_a_bad_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A folder holding a non-UTF-8 .txt and an empty .md: by default the command stops naming the
    first bad file's path and stores nothing; with --skip-bad the good file is ingested and each bad
    one is listed with its reason."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.md").write_text("Sea otters hold hands while they sleep.")
    (docs / "bin.txt").write_bytes(b"\xff\xfe\x00 binary")
    (docs / "empty.md").write_text("  \n")
    args = ["ingest", str(docs), "--data-dir", str(tmp_path / "d"), "--embedder", "hashing"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert f"{docs / 'bin.txt'}: not UTF-8 text" in err and "nothing was ingested (--skip-bad" in err
    assert main([*args, "--skip-bad"]) == 0
    out, err = capsys.readouterr()
    assert "added" in out and "a.md" in out and "bin.txt" not in out
    assert f"skipped: {docs / 'bin.txt'}: not UTF-8 text" in err
    assert f"skipped: {docs / 'empty.md'}: no text to index" in err


def test_cli_eval_writes_table_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    small = tmp_path / "small.jsonl"
    small.write_text(
        '{"question": "What does the pass statement do?", "topic": "pass"}\n'
        '{"question": "How does the while loop else clause work?", "topic": "while"}\n'
    )
    out = tmp_path / "eval.json"
    args = [
        "eval",
        "--embedder",
        "hashing",
        "--data-dir",
        str(tmp_path / "d"),
        "--eval-set",
        str(small),
        "--out",
        str(out),
    ]
    assert main(args) == 0
    table = capsys.readouterr().out
    assert "hit@5" in table and "nDCG@10" in table
    result = json.loads(out.read_text())
    assert set(result["modes"]) == {"dense", "bm25", "hybrid"}
    for scores in result["modes"].values():
        assert scores["questions"] == 2
        assert 0 <= scores["hit_at_1"] <= scores["hit_at_5"] <= scores["hit_at_10"] <= 1
    assert result["modes"]["bm25"]["hit_at_1"] == 1.0  # both questions name their topic's keyword


def test_serve_subprocess_starts_and_reuses_index(
    tmp_path: Path, free_port_factory: Callable[[], int]
) -> None:
    env = {**os.environ, "MEGALITH_DATA_DIR": str(tmp_path / "data")}
    for attempt in range(2):
        port = free_port_factory()
        cmd = [
            sys.executable,
            "-m",
            "megalith_qa.cli",
            "--port",
            str(port),
            "--llm",
            "extractive",
            "--embedder",
            "hashing",
        ]
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as resp:
                        assert json.loads(resp.read())["status"] == "ok"
                        break
                except OSError:
                    assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
                    assert time.monotonic() < deadline, "server did not become ready"
                    time.sleep(0.2)
        finally:
            proc.terminate()
            output = proc.communicate(timeout=20)[0]
        assert f"Serving on http://127.0.0.1:{port}" in output
        found = re.search(r"(\d+) sources, (\d+) \(re\)embedded", output)
        assert found, output[-2000:]
        sources, embedded = int(found[1]), int(found[2])
        assert sources >= 79  # every pydoc topic, plus the project's non-empty READMEs
        assert embedded == (sources if attempt == 0 else 0)


@pytest.fixture
def no_pipeline(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if the CLI gets as far as building the pipeline (checks must come first)."""

    def refuse(*args: object, **kwargs: object) -> None:
        pytest.fail("the pipeline was built before the bad argument was reported")

    monkeypatch.setattr("megalith_qa.cli.build_pipeline", refuse)


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--max-upload-mb", "nan"], "'nan'"),
        (["--max-upload-mb", "inf"], "'inf'"),
        (["--max-upload-mb", "0"], "'0'"),
        (["--max-new-tokens", "0"], "'0'"),
        (["--max-new-tokens", "-3"], "'-3'"),
        (["--embedder", "hashing-abc"], "'hashing-abc'"),
        (["--embedder", "hashing-4"], "'hashing-4'"),
        (["--log-level", "verbose"], "'VERBOSE'"),
        (["--port", "99999"], "'99999'"),
        (["ingest", "x.txt", "--embedder", "bert"], "'bert'"),
    ],
)
def test_bad_flags_are_usage_errors_naming_the_value(
    args: list[str], named: str, no_pipeline: None, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(args)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "qa-serve" in err and "error: argument" in err and named in err


def test_tiny_upload_limit_is_a_config_error(no_pipeline: None, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--max-upload-mb", "1e-9", "--embedder", "hashing"]) == 2
    assert "--max-upload-mb 1e-09" in capsys.readouterr().err


@pytest.mark.parametrize("url", ["http://127.0.0.1:99999", "http://127.0.0.1:port", "ftp://127.0.0.1:8000"])
def test_bad_chroma_url_is_a_config_error(
    url: str, no_pipeline: None, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--chroma-url", url, "--embedder", "hashing"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("qa-serve: error:") and repr(url) in err


def test_unreachable_chroma_server_is_a_clear_error(
    tmp_path: Path, free_port_factory: Callable[[], int], capsys: pytest.CaptureFixture[str]
) -> None:
    doc = tmp_path / "n.txt"
    doc.write_text("Otters.")
    url = f"http://127.0.0.1:{free_port_factory()}"  # nothing listens there
    assert main(["ingest", str(doc), "--chroma-url", url, "--embedder", "hashing"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("qa-serve: error:") and repr(url) in err and "cannot reach a Chroma server" in err


def test_top_level_help_points_to_the_serve_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "qa-serve serve --help" in out and "--max-upload-mb" in out and "--port" in out


def test_eval_checks_its_files_before_the_evaluation(
    tmp_path: Path, no_pipeline: None, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nonexistent.jsonl"
    assert (
        main(["eval", "--embedder", "hashing", "--data-dir", str(tmp_path / "d"), "--eval-set", str(missing)])
        == 2
    )
    assert str(missing) in capsys.readouterr().err
    folder = tmp_path / "results"
    folder.mkdir()
    assert (
        main(["eval", "--embedder", "hashing", "--data-dir", str(tmp_path / "d"), "--out", str(folder)]) == 2
    )
    err = capsys.readouterr().err
    assert repr(str(folder)) in err and "is a directory" in err
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert main(["eval", "--data-dir", str(tmp_path / "d"), "--out", str(afile / "eval.json")]) == 2
    assert "is a file" in capsys.readouterr().err


def test_eval_results_are_written_atomically(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from megalith_qa.evaluation import write_json

    out = tmp_path / "eval.json"
    write_json(out, {"run": 1})
    assert json.loads(out.read_text()) == {"run": 1}

    def crash(src: object, dst: object) -> None:
        raise OSError("crashed before the rename")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="crashed"):
        write_json(out, {"run": 2})
    assert json.loads(out.read_text()) == {"run": 1}  # the old results are untouched
    assert [p.name for p in tmp_path.iterdir()] == ["eval.json"]  # and no temporary file is left
