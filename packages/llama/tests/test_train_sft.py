"""`train` and `sft` in one process: schedules, SFT loss falls, bad input is refused."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from megalith.common.errors import ConfigError, DataError
from megalith_llama.schedule import lr_lambda
from megalith_llama.train import TrainConfig, run_training


def test_schedules_by_hand():
    cos = lr_lambda("cosine", warmup=2, total=10, min_ratio=0.1)
    assert [cos(0), cos(1)] == [0.5, 1.0]
    assert cos(2) == pytest.approx(1.0)
    assert cos(6) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert cos(10) == pytest.approx(0.1)
    wsd = lr_lambda("wsd", warmup=1, total=10, min_ratio=0.0, decay_fraction=0.2)
    assert [wsd(1), wsd(7)] == [1.0, 1.0]  # stable until step 8
    assert [wsd(8), wsd(9), wsd(10)] == pytest.approx([1.0, 0.5, 0.0])
    with pytest.raises(ConfigError, match="unknown schedule 'step'"):
        lr_lambda("step", 1, 10)


def test_config_rejects_bad_values():
    with pytest.raises(ConfigError, match="--seq-len must be > 0, got 0"):
        TrainConfig(seq_len=0)
    with pytest.raises(ConfigError, match="--schedule must be cosine, wsd or constant, got 'linear'"):
        TrainConfig(schedule="linear")


def _conversations(path: Path, n: int = 16) -> Path:
    rows = []
    for i in range(n):
        rows.append(
            {
                "messages": [
                    {"role": "user", "content": f"the model learns tokens {i % 4}"},
                    {"role": "assistant", "content": "zero redundancy optimizer shards states across ranks"},
                ]
            }
        )
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_sft_loss_decreases_and_exports(tmp_path, bpe_tokenizer_dir, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    data = _conversations(tmp_path / "chat.jsonl")
    cfg = TrainConfig(
        model="tiny-32",
        tokenizer=str(bpe_tokenizer_dir),
        sft_data=str(data),
        seq_len=48,
        batch_size=4,
        max_steps=40,
        lr=1e-2,
        warmup_steps=1,
        schedule="constant",
        save_every=20,
        eval_batches=1,
        plugin="zero2",
        output=str(tmp_path / "run"),
        data_dir=str(tmp_path / "data"),
        neftune_alpha=1.0,
        device="cpu",
    )
    result = run_training(cfg)
    rows = [json.loads(line) for line in result.metrics.read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) == 40
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 1.0, losses  # at least 1 nat/token lower
    assert (result.final_model / "config.json").exists()
    assert (result.checkpoints / "step_00000040" / "state.json").exists()


def test_sft_bad_line_names_file_and_line(tmp_path, bpe_tokenizer_dir, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    data = _conversations(tmp_path / "chat.jsonl", 2)
    data.write_text(data.read_text() + '{"messages": "not a list"}\n')
    cfg = TrainConfig(
        model="tiny-32",
        tokenizer=str(bpe_tokenizer_dir),
        sft_data=str(data),
        seq_len=48,
        max_steps=1,
        output=str(tmp_path / "run"),
        data_dir=str(tmp_path / "data"),
        device="cpu",
    )
    with pytest.raises(DataError, match=r"chat\.jsonl:3"):
        run_training(cfg)
