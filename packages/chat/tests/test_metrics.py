"""metrics.jsonl on resume: rows logged after the checkpoint are dropped (atomically), and the
GRPO summary and reward curve cover the whole run. The engine's Ray calls are stubbed out."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from megalith.common.errors import DataError
from megalith_chat.engine import driver
from megalith_chat.engine.config import EngineConfig, GRPORunConfig, PromptSource
from megalith_chat.engine.driver import GRPOEngine
from megalith_chat.metrics import MetricsWriter, read_metrics, truncate_metrics


def _write_rows(path: Path, steps: list[int], tail: str = "") -> None:
    rows = [{"step": s, "reward_mean": float(s)} for s in steps]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + tail)


def test_truncate_metrics_keeps_rows_before_the_resumed_step(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    _write_rows(path, [-1, 0, 1, 2, 3], tail='{"step": 4, "rew')  # a crash cut the last line
    assert truncate_metrics(path, 2) == 3
    assert [r["step"] for r in read_metrics(path)] == [-1, 0, 1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]  # no temporary file left
    assert truncate_metrics(tmp_path / "absent.jsonl", 2) == 0
    assert not (tmp_path / "absent.jsonl").exists()


def test_metrics_writer_from_step_starts_fresh_or_continues(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    _write_rows(path, [0, 1, 2])
    writer = MetricsWriter.from_step(path, 2)  # resume at step 2: rows 0, 1 kept, then appended
    writer.write({"step": 2, "reward_mean": 7.0})
    writer.close()
    assert [(r["step"], r["reward_mean"]) for r in read_metrics(path)] == [(0, 0.0), (1, 1.0), (2, 7.0)]
    MetricsWriter.from_step(path, 0).close()  # a run from step 0 starts a fresh file
    assert read_metrics(path) == []


def test_grpo_resume_rewrites_metrics_and_summarises_the_whole_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first session logged steps 0..2 and checkpointed after step 1; the resumed session
    starts at step 2 and runs to step 3: every step appears once, and the summary, history and
    plot cover steps 0..3 (before the fix: ``0 1 2 2 3`` and a 2-step summary)."""
    _write_rows(tmp_path / "metrics.jsonl", [0, 1, 2])
    config = GRPORunConfig(out_dir=str(tmp_path), prompts=PromptSource(task="reverse"), steps=4, export=False)
    engine = GRPOEngine(config)
    monkeypatch.setattr(engine, "_step", lambda step, buffer: {"step": step, "reward_mean": 10.0 + step})
    summary = engine._loop(first=2, start=time.perf_counter())
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [(r["step"], r["reward_mean"]) for r in rows] == [(0, 0.0), (1, 1.0), (2, 12.0), (3, 13.0)]
    assert summary.steps == 4 and [r["step"] for r in summary.history] == [0, 1, 2, 3]
    assert summary.mean_reward(True, n=2) == pytest.approx(0.5)
    assert summary.plot_path is not None and Path(summary.plot_path).is_file()


def test_bad_prompts_file_fails_before_ray_starts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bad = tmp_path / "prompts.jsonl"
    bad.write_text('{"prompt": "ok", "answer": "1"}\n{"question": "no prompt"}\n')

    def no_ray(*args: Any) -> bool:
        raise AssertionError("Ray was started before the prompts were read")

    monkeypatch.setattr(driver, "resolve_model", lambda spec, root: Path(spec))
    monkeypatch.setattr(driver, "start_ray", no_ray)
    config = GRPORunConfig(
        model=str(tmp_path),
        out_dir=str(tmp_path / "out"),
        prompts=PromptSource(task=None, prompts_file=str(bad), reward="math"),
        engine=EngineConfig(num_consumers=1),
    )
    with pytest.raises(DataError, match=f"{bad}:2:"):
        GRPOEngine(config).run()
