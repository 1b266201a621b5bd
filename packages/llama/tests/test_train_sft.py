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
    """Steps s = 0 .. S-1; the formulas are written out here, not taken from the module."""
    S, W, m = 10, 2, 0.1
    cos = lr_lambda("cosine", warmup=W, total=S, min_ratio=m)
    # warmup (s+1)/W, then m + (1-m)(1 + cos(pi (s-W+1)/(S-W)))/2
    expected = [0.5, 1.0] + [m + (1 - m) * 0.5 * (1 + math.cos(math.pi * (s - 1) / 8)) for s in range(2, 10)]
    assert [cos(s) for s in range(S)] == pytest.approx(expected)
    assert cos(2) < 1.0  # decay starts right after warmup (no second step at the peak)
    assert cos(S - 1) == pytest.approx(m)  # the last step that runs is at min_ratio exactly
    # wsd, S=10, decay_fraction 0.2: D = 2 decay steps (8, 9): 1 - (1-m)(s-8+1)/2
    wsd = lr_lambda("wsd", warmup=1, total=S, min_ratio=0.0, decay_fraction=0.2)
    assert [wsd(s) for s in range(S)] == pytest.approx([1.0] * 8 + [0.5, 0.0])
    # the defaults of `train`: S=20, W=2, m=0.1, D=4: every decay step decays, the last to m
    d = lr_lambda("wsd", warmup=2, total=20, min_ratio=0.1, decay_fraction=0.2)
    decay = [1 - 0.9 * (s - 16 + 1) / 4 for s in range(16, 20)]
    assert [d(s) for s in range(20)] == pytest.approx([0.5] + [1.0] * 15 + decay)
    assert decay == pytest.approx([0.775, 0.55, 0.325, 0.1])
    const = lr_lambda("constant", warmup=4, total=S)
    assert [const(s) for s in range(6)] == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0, 1.0])
    with pytest.raises(ConfigError, match="unknown schedule 'step'"):
        lr_lambda("step", 1, 10)


def test_config_rejects_bad_values():
    with pytest.raises(ConfigError, match="--seq-len must be > 0, got 0"):
        TrainConfig(seq_len=0)
    with pytest.raises(ConfigError, match="--schedule must be cosine, wsd or constant, got 'linear'"):
        TrainConfig(schedule="linear")
    with pytest.raises(ConfigError, match=r"--clip must be >= 0 \(0 turns clipping off\), got -1.0"):
        TrainConfig(clip=-1.0)
    with pytest.raises(ConfigError, match="--clip must be >= 0.*got nan"):
        TrainConfig(clip=float("nan"))
    assert TrainConfig(clip=0.0).clip == 0.0  # off
    for keep in (0, -1):
        with pytest.raises(ConfigError, match=f"--keep-checkpoints must be > 0, got {keep}"):
            TrainConfig(keep_checkpoints=keep)
    with pytest.raises(ConfigError, match="--overwrite .* --resume auto"):
        TrainConfig(overwrite=True, resume="auto")


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
