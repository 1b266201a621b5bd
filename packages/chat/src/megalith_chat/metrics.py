"""Run metrics: one JSON object per step in ``metrics.jsonl`` and a reward-curve PNG."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from megalith.checkpoint import atomic

logger = logging.getLogger(__name__)


class MetricsWriter:
    """Appends ``{"step": ..., **metrics}`` lines (flushed per line, so a crash keeps what was logged)."""

    def __init__(self, path: str | Path, append: bool = False) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "a" if append else "w", encoding="utf-8")
        self.rows: list[dict[str, Any]] = []

    @classmethod
    def from_step(cls, path: str | Path, first_step: int) -> MetricsWriter:
        """A writer for a run that starts at ``first_step``: a fresh file at step 0; on a resume the
        rows of the steps that run again are dropped (:func:`truncate_metrics`) and the rest kept."""
        if first_step > 0:
            truncate_metrics(path, first_step)
        return cls(path, append=first_step > 0)

    def write(self, row: Mapping[str, Any]) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
        self.rows.append(clean)
        self._f.write(json.dumps(clean) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def truncate_metrics(path: str | Path, first_step: int) -> int:
    """Keep only the rows of ``path`` with ``step < first_step`` (a resume from the checkpoint of
    step ``first_step - 1`` logs the later steps again); returns how many rows were dropped.

    Rewritten atomically: a temporary file in the same folder, then ``os.replace``. A line cut off
    by a crash (not valid JSON) is dropped too. A missing file is left missing.
    """
    path = Path(path)
    if not path.is_file():
        return 0
    kept: list[str] = []
    dropped = 0
    with open(path, encoding="utf-8") as f:
        for line in filter(str.strip, f):
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                row = None
            step = row.get("step") if isinstance(row, dict) else None
            if isinstance(step, int) and step < first_step:
                kept.append(line if line.endswith("\n") else line + "\n")
            else:
                dropped += 1
    atomic.write_text(path, "".join(kept))
    if dropped:
        logger.warning(
            "%s: dropped %d rows logged after the checkpoint (step >= %d)", path, dropped, first_step
        )
    return dropped


def plot_reward_curve(rows: Sequence[Mapping[str, Any]], out: str | Path, title: str = "GRPO") -> Path:
    """Reward mean ± std per step (and accuracy) as a PNG, drawn with matplotlib's Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows if r.get("reward_mean") is not None]
    mean = [r["reward_mean"] for r in rows if r.get("reward_mean") is not None]
    std = [r.get("reward_std") or 0.0 for r in rows if r.get("reward_mean") is not None]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.plot(steps, mean, label="reward mean", color="tab:blue")
    ax.fill_between(
        steps,
        [m - s for m, s in zip(mean, std)],
        [m + s for m, s in zip(mean, std)],
        alpha=0.2,
        color="tab:blue",
        label="± std",
    )
    acc = [(r["step"], r["accuracy"]) for r in rows if r.get("accuracy") is not None]
    if acc:
        ax.plot([a for a, _ in acc], [b for _, b in acc], label="accuracy", color="tab:green")
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.set_title(title)
    ax.legend(loc="best")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out)
    plt.close(fig)
    return out
