"""chat-train sft / dpo / rm on a tiny Llama: SFT loss falls, the DPO margin rises, RM accuracy beats chance."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from megalith_chat.cli import main
from megalith_chat.metrics import read_metrics

PAIRS = [
    ("what is two plus two", "four", "two two"),
    ("hello there", "i am fine thanks", "you you"),
    ("how are you today", "i am fine", "what what"),
    ("reverse the digits 1 2 3", "3 2 1", "1 2 3"),
]


def _write(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _run(command: str, model_dir: Path, data: Path, out: Path, *extra: str) -> list[dict]:
    args = [
        command,
        "--model",
        str(model_dir),
        "--data",
        str(data),
        "--out",
        str(out),
        "--no-progress",
        "--batch-size",
        "2",
        *extra,
    ]
    assert main(args) == 0
    assert (out / "model" / "config.json").is_file()
    return read_metrics(out / "metrics.jsonl")


def test_sft_loss_decreases(model_dir: Path, tmp_path: Path) -> None:
    data = _write(tmp_path / "sft.jsonl", [{"prompt": p, "response": c} for p, c, _ in PAIRS])
    rows = _run("sft", model_dir, data, tmp_path / "sft", "--steps", "30", "--lr", "1e-2", "--plugin", "ddp")
    first, last = sum(r["loss"] for r in rows[:4]) / 4, sum(r["loss"] for r in rows[-4:]) / 4
    assert last < 0.5 * first, (first, last)


def test_dpo_margin_rises(model_dir: Path, tmp_path: Path) -> None:
    data = _write(tmp_path / "pref.jsonl", [{"prompt": p, "chosen": c, "rejected": r} for p, c, r in PAIRS])
    rows = _run(
        "dpo", model_dir, data, tmp_path / "dpo", "--steps", "20", "--lr", "5e-3", "--grad-accum", "2"
    )
    assert abs(rows[0]["margin"]) < 1e-4  # policy == reference at the start: margin exactly ~0
    assert sum(r["margin"] for r in rows[-4:]) / 4 > 0.5


def test_reward_model_accuracy_beats_chance(model_dir: Path, tmp_path: Path) -> None:
    data = _write(tmp_path / "pref.jsonl", [{"prompt": p, "chosen": c, "rejected": r} for p, c, r in PAIRS])
    rows = _run("rm", model_dir, data, tmp_path / "rm", "--steps", "30", "--lr", "5e-3")
    assert sum(r["accuracy"] for r in rows[-5:]) / 5 > 0.75


def test_supervised_bad_inputs(
    model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from megalith_chat.trainer import runs

    loaded: list[Path] = []
    monkeypatch.setattr(runs, "load_policy", lambda path, *a: loaded.append(path))
    bad = _write(tmp_path / "bad.jsonl", [{"prompt": "hi"}])
    assert main(["sft", "--model", str(model_dir), "--data", str(bad), "--out", str(tmp_path / "o")]) == 2
    assert f"{bad}:1" in capsys.readouterr().err
    assert loaded == []  # the bad record is reported before the model loads
    assert main(["sft", "--model", str(tmp_path / "missing"), "--data", str(bad)]) == 2
    assert "neither 'smollm2'" in capsys.readouterr().err
    # with several ranks both are refused by the launching process, before any rank starts
    import megalith.distributed as distributed

    monkeypatch.setattr(distributed, "relaunch", lambda *a, **k: pytest.fail("ranks were started"))
    two = ["--nproc-per-node", "2", "--out", str(tmp_path / "o2")]
    assert main(["sft", "--model", str(tmp_path / "missing"), "--data", str(bad), *two]) == 2
    assert "neither 'smollm2'" in capsys.readouterr().err
    assert main(["dpo", "--model", str(model_dir), "--data", str(tmp_path / "none.jsonl"), *two]) == 2
    assert f"--data {tmp_path / 'none.jsonl'}: no such file" in capsys.readouterr().err


def test_failed_ranks_give_their_exit_code(
    model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With --nproc-per-node 2 the command exits with the first failed rank's code (the launcher
    has printed which rank failed), without an error line of its own."""
    import megalith.distributed as distributed

    monkeypatch.setattr(distributed, "relaunch", lambda *a, **k: 3)
    data = _write(tmp_path / "ok.jsonl", [{"prompt": "hi", "response": "there"}])
    argv = ["sft", "--model", str(model_dir), "--data", str(data), "--nproc-per-node", "2"]
    assert main([*argv, "--out", str(tmp_path / "o")]) == 3
    assert "error" not in capsys.readouterr().err


def test_truncation_that_leaves_no_trained_token_names_the_line(chat_tokenizer: Any, tmp_path: Path) -> None:
    """A prompt that fills --max-length leaves a side with no trained token: DataError at file:line."""
    from megalith.common.errors import DataError
    from megalith_chat.trainer.supervised import preference_dataset, sft_dataset

    long_prompt = "hello there how are you today"  # 9 tokens before the response with the headers
    sides = {"chosen": "four", "rejected": "two two"}
    pairs = [{"prompt": "hi", **sides}, {"prompt": long_prompt, **sides}]
    pref = _write(tmp_path / "pref.jsonl", pairs)
    assert len(preference_dataset(str(pref), chat_tokenizer, 64)) == 2
    with pytest.raises(DataError, match="the chosen response has no trained token") as info:
        preference_dataset(str(pref), chat_tokenizer, 6)
    assert f"{pref}:2:" in str(info.value) and "max_length=6" in str(info.value)
    sft = _write(
        tmp_path / "sft.jsonl",
        [{"prompt": "hi", "response": "four"}, {"prompt": long_prompt, "response": "x"}],
    )
    assert len(sft_dataset(str(sft), chat_tokenizer, 64)) == 2
    with pytest.raises(DataError, match="no trained token") as info:
        sft_dataset(str(sft), chat_tokenizer, 6)
    assert f"{sft}:2:" in str(info.value)


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--batch-size", "0"),
        ("--grad-accum", "0"),
        ("--nproc-per-node", "0"),
        ("--steps", "0"),
        ("--steps", "-4"),
        ("--max-length", "0"),
        ("--max-length", "-3"),
        ("--save-every", "-1"),
        ("--lr", "0"),
    ],
)
def test_bad_sizes_are_rejected_before_any_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str, value: str
) -> None:
    """The model path does not exist: the flag's error must come first (nothing is loaded)."""
    import re

    from megalith.common.errors import ConfigError
    from megalith_chat.cli import build_parser
    from megalith_chat.commands import check_supervised_args

    data = _write(tmp_path / "sft.jsonl", [{"prompt": "hi", "response": "four"}])
    argv = ["sft", "--model", str(tmp_path / "missing"), "--data", str(data), "--no-progress", flag, value]
    named = rf"{re.escape(flag)} must be [^,]*, got {re.escape(value)}\b"
    with pytest.raises(ConfigError, match=named):
        check_supervised_args(build_parser().parse_args(argv))
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert re.search(named, err) and "neither 'smollm2'" not in err


def test_sft_resume_drops_rows_logged_after_the_checkpoint(model_dir: Path, tmp_path: Path) -> None:
    """Steps 4 and 5 were logged but not checkpointed (a crash): the resumed run logs them once."""
    data = _write(tmp_path / "sft.jsonl", [{"prompt": p, "response": c} for p, c, _ in PAIRS])
    out = tmp_path / "run"
    _run("sft", model_dir, data, out, "--steps", "4", "--save-every", "2", "--plugin", "ddp")
    with open(out / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 4, "loss": -1.0}) + "\n" + json.dumps({"step": 5, "loss": -1.0}) + "\n")
    rows = _run(
        "sft", model_dir, data, out, "--steps", "6", "--save-every", "2", "--plugin", "ddp", "--resume"
    )
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4, 5]
    assert all(r["loss"] > 0 for r in rows)  # the stale rows of steps 4 and 5 are gone
