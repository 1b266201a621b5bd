"""Pieces of the training recipe without a training run: the batch source at epoch edges, checkpoint
pruning, the metrics log on resume, `--max-tokens` steps, the atomic `final/` export."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from megalith.common.errors import ConfigError, DataError
from megalith_llama.loop import StepLoop
from megalith_llama.train import _export, _total_steps, check_data_size, check_fresh_output
from megalith_llama.train_config import TrainConfig
from megalith_llama.train_utils import MetricsLog, latest_checkpoint, prune_checkpoints


class _Loader:
    """Each `iter()` is the next epoch's list of batches (what `StatefulDataLoader` does)."""

    def __init__(self, *epochs: list[dict[str, torch.Tensor]]) -> None:
        self.epochs, self.iters = list(epochs), 0

    def __iter__(self) -> Any:
        self.iters += 1
        return iter(self.epochs.pop(0) if self.epochs else [])


def _loop(loader: _Loader) -> StepLoop:
    loop = object.__new__(StepLoop)  # only what `_next_batch` reads
    loop.cfg = TrainConfig(batch_size=2)
    loop.loader, loop.model, loop.device = loader, torch.nn.Linear(1, 1), torch.device("cpu")
    loop._batches = iter(())
    return loop


def _batch(value: int) -> dict[str, torch.Tensor]:
    ids = torch.full((2, 4), value)
    return {"input_ids": ids, "labels": ids}


def test_next_batch_starts_a_new_epoch_after_an_empty_rest() -> None:
    """A resume at an epoch's end: the first fresh iterator holds only the dropped partial batch
    (nothing), the next one is a new epoch."""
    loader = _Loader([], [_batch(7)])
    batch = _loop(loader)._next_batch()
    assert loader.iters == 2 and torch.equal(batch["input_ids"], _batch(7)["input_ids"])


def test_next_batch_raises_data_error_when_an_epoch_is_empty() -> None:
    loader = _Loader([], [])
    with pytest.raises(DataError, match="--batch-size 2"):
        _loop(loader)._next_batch()
    assert loader.iters == 2  # gives up after a whole empty epoch, never loops forever


def test_data_smaller_than_one_batch_per_rank_names_both_sizes() -> None:
    check_data_size(4, 2, 2)  # exactly one batch per rank
    with pytest.raises(
        ConfigError, match=r"3 sequence\(s\), 1 per data-parallel rank \(dp size 2\).*--batch-size 2"
    ):
        check_data_size(3, 2, 2)
    with pytest.raises(ConfigError, match=r"has 1 sequence\(s\).*--batch-size 2"):
        check_data_size(1, 2, 1)


def _steps(root: Path, *steps: int) -> None:
    for s in steps:
        (root / f"step_{s:08d}").mkdir(parents=True)
        (root / f"step_{s:08d}" / "state.json").write_text("{}")


def _names(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def test_prune_never_deletes_the_checkpoint_just_written(tmp_path: Path) -> None:
    _steps(tmp_path, 2, 4)  # an earlier trajectory's checkpoints ...
    _steps(tmp_path, 1)  # ... and the one this run just wrote
    prune_checkpoints(tmp_path, 1, newest=tmp_path / "step_00000001")
    assert _names(tmp_path) == ["step_00000001", "step_00000002", "step_00000004"]
    _steps(tmp_path, 3)
    prune_checkpoints(tmp_path, 2, newest=tmp_path / "step_00000003")
    assert _names(tmp_path) == ["step_00000002", "step_00000003", "step_00000004"]
    with pytest.raises(ConfigError, match="keep_checkpoints must be >= 1, got 0"):
        prune_checkpoints(tmp_path, 0, newest=tmp_path / "step_00000003")


def test_prune_and_latest_go_by_step_number(tmp_path: Path) -> None:
    _steps(tmp_path, 99999999, 100000000)  # past 8 digits the names no longer sort by step
    assert latest_checkpoint(tmp_path) == tmp_path / "step_100000000"
    prune_checkpoints(tmp_path, 1)
    assert _names(tmp_path) == ["step_100000000"]


def test_fresh_run_refuses_an_output_with_checkpoints(tmp_path: Path) -> None:
    check_fresh_output(TrainConfig(), tmp_path)  # nothing there yet
    _steps(tmp_path / "checkpoints", 4)
    with pytest.raises(ConfigError, match=r"already holds checkpoints of an earlier run \(step_00000004\)"):
        check_fresh_output(TrainConfig(), tmp_path)
    check_fresh_output(TrainConfig(resume="auto"), tmp_path)
    check_fresh_output(TrainConfig(overwrite=True), tmp_path)


def test_metrics_resume_drops_a_torn_last_line(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": 0, "val_loss": 6.0}, {"step": 1, "loss": 6.0}, {"step": 2, "loss": 5.9}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 3, "loss": 5.9')
    with caplog.at_level(logging.WARNING, logger="megalith_llama.train_utils"):
        MetricsLog(path, enabled=True, truncate_after=1)
    assert [json.loads(line) for line in path.read_text().splitlines()] == rows[:2]
    assert f"{path}:4: dropping a partial last line" in caplog.text
    assert not list(tmp_path.glob("*.tmp"))  # rewritten through a temporary file, then renamed


def test_metrics_resume_refuses_a_bad_line_in_the_middle(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 6.0}\ngarbage\n{"step": 2, "loss": 5.9}\n')
    with pytest.raises(DataError, match=rf"{path}:2: not a metrics record"):
        MetricsLog(path, enabled=True, truncate_after=2)


def test_max_tokens_counts_data_parallel_ranks_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step trains batch x accum x seq_len tokens per dp rank: 2 x 1 x 64 = 128 at dp 1
    (e.g. tp 2 on 2 ranks), so 1024 tokens take 8 steps whatever the world size is."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = TrainConfig(batch_size=2, seq_len=64, max_tokens=1024, max_steps=100)
    assert _total_steps(cfg, dp_size=1) == 8
    assert _total_steps(cfg, dp_size=2) == 4
    assert _total_steps(TrainConfig(max_steps=7), dp_size=2) == 7


class _Booster:
    def unwrap(self, model: Any) -> Any:
        return model

    def save_model(self, model: Any, path: Path) -> Path:
        path.mkdir(parents=True, exist_ok=True)
        (path / "config.json").write_text(json.dumps({"model": model}))
        return path


class _Tokenizer:
    def __init__(self, fail: bool) -> None:
        self.fail = fail

    def save_pretrained(self, path: str) -> None:
        if self.fail:
            raise RuntimeError("killed while writing the tokenizer")
        (Path(path) / "tokenizer.json").write_text("{}")


def test_export_renames_final_only_with_the_tokenizer_in_it(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="killed"):
        _export(_Booster(), "first", _Tokenizer(fail=True), tmp_path)
    assert not (tmp_path / "final").exists()  # never a final/ without its tokenizer
    final = _export(_Booster(), "second", _Tokenizer(fail=False), tmp_path)
    assert final == tmp_path / "final"
    assert _names(final) == ["config.json", "tokenizer.json"]
    assert json.loads((final / "config.json").read_text()) == {"model": "second"}
    with pytest.raises(RuntimeError, match="killed"):
        _export(_Booster(), "third", _Tokenizer(fail=True), tmp_path)
    assert json.loads((final / "config.json").read_text()) == {"model": "second"}  # old export intact
