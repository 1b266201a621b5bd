"""``chat-train`` CLI: inspect-data (colour and plain markers) and make-task."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from megalith_chat.cli import main


def test_help_does_not_import_torch() -> None:
    """Building the parser (``--help``) loads no torch: the heavy imports wait for the commands."""
    code = "import sys; from megalith_chat.cli import build_parser; build_parser(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory, chat_tokenizer: Any) -> Path:
    path = tmp_path_factory.mktemp("tok")
    chat_tokenizer.save_pretrained(str(path))
    return path


@pytest.fixture
def sft_file(tmp_path: Path) -> Path:
    record = {
        "messages": [
            {"role": "user", "content": "what is two plus two"},
            {"role": "assistant", "content": "four"},
        ]
    }
    path = tmp_path / "sft.jsonl"
    path.write_text(json.dumps(record) + "\n")
    return path


def test_inspect_data_plain_markers(
    tokenizer_dir: Path, sft_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["inspect-data", "--data", str(sft_file), "--tokenizer", str(tokenizer_dir), "--no-color"])
    out = capsys.readouterr().out
    assert code == 0
    assert "<|user|> what is two plus two <|end|> <|assistant|>[[four <|end|>]]" in out
    assert "\x1b[" not in out
    assert f"=== {sft_file}:1 ===" in out and "10 tokens, 2 trained on (20.0%)" in out


def test_inspect_data_ansi_colours(
    tokenizer_dir: Path, sft_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["inspect-data", "--data", str(sft_file), "--tokenizer", str(tokenizer_dir)]) == 0
    out = capsys.readouterr().out
    assert "\x1b[1;32mfour <|end|>\x1b[0m" in out
    assert "[[" not in out.split("\n", 1)[1]


def test_inspect_builtin_task_and_preference(
    tokenizer_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["inspect-data", "--task", "reverse", "--tokenizer", str(tokenizer_dir), "--no-color"]) == 0
    out = capsys.readouterr().out
    assert "prompt only" in out and "answer:" in out
    pref = tmp_path / "pref.jsonl"
    pref.write_text(json.dumps({"prompt": "hello there", "chosen": "four", "rejected": "two two"}) + "\n")
    args = ["inspect-data", "--data", str(pref), "--kind", "preference", "--tokenizer", str(tokenizer_dir)]
    assert main([*args, "--no-color"]) == 0
    out = capsys.readouterr().out
    assert "[[four <|end|>]]" in out and "[[two two <|end|>]]" in out


def test_inspect_data_reports_bad_line(
    tokenizer_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": []}\n')
    assert main(["inspect-data", "--data", str(bad), "--tokenizer", str(tokenizer_dir)]) == 2
    assert f"{bad}:1" in capsys.readouterr().err
    assert main(["inspect-data", "--data", str(bad), "--tokenizer", str(tmp_path / "nope")]) == 2


def test_make_task_writes_loadable_prompts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sub" / "arith.jsonl"
    assert main(["make-task", "--task", "arithmetic", "--num", "5", "--seed", "1", "--out", str(out)]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 5 and all({"prompt", "answer", "task"} <= set(r) for r in records)
    assert "wrote 5 arithmetic prompts" in capsys.readouterr().out
    assert main(["make-task", "--task", "arithmetic", "--num", "0", "--out", str(out)]) == 2


def test_help_lists_every_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "inspect-data" in out and "make-task" in out
    with pytest.raises(SystemExit):
        main(["inspect-data", "--help"])
    assert "--no-color" in capsys.readouterr().out


def test_make_task_into_a_directory_names_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from megalith.common.errors import ConfigError
    from megalith_chat.cli import _make_task, build_parser

    args = build_parser().parse_args(["make-task", "--task", "reverse", "--num", "3", "--out", str(tmp_path)])
    with pytest.raises(ConfigError, match="is a directory") as info:
        _make_task(args)
    assert str(tmp_path) in str(info.value)
    assert main(["make-task", "--task", "reverse", "--num", "3", "--out", str(tmp_path)]) == 2
    assert f"--out {tmp_path} is a directory" in capsys.readouterr().err


def test_make_task_unwritable_path_is_a_config_error(tmp_path: Path) -> None:
    from megalith.common.errors import ConfigError
    from megalith_chat.cli import _make_task, build_parser

    blocker = tmp_path / "file"
    blocker.write_text("")
    out = blocker / "sub" / "t.jsonl"  # the parent "folder" is a file
    args = build_parser().parse_args(["make-task", "--task", "reverse", "--num", "3", "--out", str(out)])
    with pytest.raises(ConfigError, match="cannot write") as info:
        _make_task(args)
    assert str(out) in str(info.value)
