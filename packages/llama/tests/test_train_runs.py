"""Short `train` runs (tiny-32, seq_len 16, one process) at the edges: a resume at the end of an
epoch, data smaller than one batch, an --output holding an earlier run, `--clip 0`."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from megalith.common.errors import ConfigError
from megalith_llama.data import InputSpec, PrepareConfig, prepare
from megalith_llama.train import TrainConfig, run_training


def _data(tmp: Path, tokenizer, sentences: list[str], name: str) -> tuple[Path, int]:
    src = tmp / f"{name}.jsonl"
    src.write_text("".join(json.dumps({"text": s}) + "\n" for s in sentences))
    result = prepare(PrepareConfig((InputSpec(str(src)),), seq_len=16), tokenizer, tmp / name)
    return result.output, result.manifest["num_sequences"]


def _config(tmp: Path, tokenizer_dir: Path, data: Path, **overrides: object) -> TrainConfig:
    base = TrainConfig(
        model="tiny-32", tokenizer=str(tokenizer_dir), data=str(data), seq_len=16, batch_size=2,
        max_steps=3, save_every=2, keep_checkpoints=5, eval_batches=1, lr=1e-2, warmup_steps=0,
        schedule="constant", plugin="ddp", output=str(tmp / "run"), data_dir=str(tmp / "cache"),
        device="cpu",
    )  # fmt: skip
    return replace(base, **overrides)  # type: ignore[arg-type]


def _rows(output: Path) -> list[dict]:
    return [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]


def _losses(output: Path) -> list[float]:
    return [r["loss"] for r in _rows(output) if "loss" in r]


@pytest.fixture(autouse=True)
def _one_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)


def test_resume_at_the_end_of_an_epoch(tmp_path, bpe_tokenizer, bpe_tokenizer_dir, make_sentences) -> None:
    """7 rows, batch 2: an epoch is 3 batches (1 row dropped). The step-3 checkpoint is taken at the
    epoch's end, so the resumed loader's first iterator is empty; the run must go on with the next
    epoch and give the uninterrupted run's step-4 loss."""
    data, rows = _data(tmp_path, bpe_tokenizer, make_sentences(8, seed=3), "d7")
    assert rows == 7
    cfg = _config(tmp_path, bpe_tokenizer_dir, data, max_steps=4, save_every=3)
    straight = _losses(run_training(cfg).output)
    assert len(straight) == 4
    shutil.rmtree(tmp_path / "run" / "checkpoints" / "step_00000004")
    resumed = run_training(replace(cfg, resume="auto"))
    assert _losses(resumed.output) == straight  # bitwise, on CPU


def test_data_smaller_than_one_batch_is_refused_before_training(
    tmp_path, bpe_tokenizer, bpe_tokenizer_dir, make_sentences
) -> None:
    data, rows = _data(tmp_path, bpe_tokenizer, make_sentences(1), "d1")
    assert rows == 1
    with pytest.raises(ConfigError, match=r"has 1 sequence\(s\).*--batch-size 2"):
        run_training(_config(tmp_path, bpe_tokenizer_dir, data))
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_fresh_run_into_an_earlier_runs_output(
    tmp_path, bpe_tokenizer, bpe_tokenizer_dir, make_sentences
) -> None:
    """Without --resume, an --output holding checkpoints is refused (they are named); with
    --overwrite they are deleted and the new run's own checkpoint is kept."""
    data, _ = _data(tmp_path, bpe_tokenizer, make_sentences(12), "d")
    run_training(_config(tmp_path, bpe_tokenizer_dir, data, max_steps=4))
    checkpoints = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_00000002", "step_00000004"]
    fresh = _config(tmp_path, bpe_tokenizer_dir, data, max_steps=1, save_every=1, keep_checkpoints=1)
    with pytest.raises(ConfigError, match=r"already holds checkpoints.*step_00000002, step_00000004"):
        run_training(fresh)
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_00000002", "step_00000004"]
    run_training(replace(fresh, overwrite=True))
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_00000001"]
    assert [r["step"] for r in _rows(tmp_path / "run") if "loss" in r] == [1]


def test_clip_zero_means_no_clipping(tmp_path, bpe_tokenizer, bpe_tokenizer_dir, make_sentences) -> None:
    """`--clip 0` trains exactly like a clip no gradient reaches (it used to zero every gradient)."""
    data, _ = _data(tmp_path, bpe_tokenizer, make_sentences(12), "d")
    off = _losses(
        run_training(_config(tmp_path, bpe_tokenizer_dir, data, clip=0.0, output=str(tmp_path / "a"))).output
    )
    huge = _losses(
        run_training(_config(tmp_path, bpe_tokenizer_dir, data, clip=1e9, output=str(tmp_path / "b"))).output
    )
    assert off == huge
    assert off[2] < off[0]  # it trains
