"""chat-train sft / dpo / rm on a tiny Llama: SFT loss falls, the DPO margin rises, RM accuracy beats chance."""

from __future__ import annotations

import json
from pathlib import Path

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


def test_supervised_bad_inputs(model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = _write(tmp_path / "bad.jsonl", [{"prompt": "hi"}])
    assert main(["sft", "--model", str(model_dir), "--data", str(bad), "--out", str(tmp_path / "o")]) == 2
    assert f"{bad}:1" in capsys.readouterr().err
    assert main(["sft", "--model", str(tmp_path / "missing"), "--data", str(bad)]) == 2
    assert "neither 'smollm2'" in capsys.readouterr().err
