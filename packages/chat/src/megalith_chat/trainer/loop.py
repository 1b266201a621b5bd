"""The supervised training loop shared by SFT, DPO and reward-model training.

``loss_fn(model, batch) -> (loss, metrics)``; gradient accumulation runs ``grad_accum``
micro-batches (each scaled by ``1/grad_accum``) under ``booster.no_sync`` except the last, then
clips the global gradient norm and steps. Every ``save_every`` optimizer steps (and at the end)
the full state -- model, optimizer, dataloader position, every rank's RNG, step -- is saved with
``booster.save_state``; ``resume=True`` continues from it exactly.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from megalith.booster import Booster
from megalith.common.errors import ConfigError
from megalith.distributed import rank as dist_rank
from megalith_chat.metrics import MetricsWriter
from megalith_chat.trainer.setup import all_reduce_mean, dp_info

logger = logging.getLogger(__name__)

LossFn = Callable[[nn.Module, dict[str, torch.Tensor]], tuple[torch.Tensor, dict[str, float]]]
PipelineStep = Callable[[Booster, nn.Module, Any, dict[str, torch.Tensor], int], dict[str, float]]


@dataclass(frozen=True)
class LoopConfig:
    """Optimisation schedule of a supervised run."""

    steps: int = 50
    grad_accum: int = 1
    max_grad_norm: float = 1.0
    save_every: int = 0
    resume: bool = False
    out_dir: str = "runs/sft"

    def __post_init__(self) -> None:
        if self.steps < 1 or self.grad_accum < 1 or self.save_every < 0 or self.max_grad_norm <= 0:
            raise ConfigError(
                f"need steps >= 1, grad_accum >= 1, save_every >= 0, max_grad_norm > 0; got {self}"
            )


def _batches(loader: Any) -> Iterator[dict[str, torch.Tensor]]:
    """Cycle through the (stateful) loader forever; its sampler starts the next epoch by itself."""
    while True:
        empty = True
        for batch in loader:
            empty = False
            yield batch
        if empty:
            raise ConfigError(
                "the dataset yields no batch: fewer examples than batch_size x data-parallel ranks"
            )


def train_loop(
    booster: Booster,
    model: nn.Module,
    optimizer: Any,
    loader: Any,
    loss_fn: LossFn,
    config: LoopConfig,
    progress: bool = False,
    pipeline_step: PipelineStep | None = None,
) -> list[dict[str, float]]:
    """Run ``config.steps`` optimizer steps; returns the per-step metrics (also in ``metrics.jsonl``).
    ``pipeline_step(booster, model, optimizer, batch, grad_accum) -> metrics`` replaces forward +
    backward under pipeline parallelism (``trainer.pp.sft_step``)."""
    out = Path(config.out_dir)
    ckpt = out / "checkpoint"
    first = 0
    if config.resume and (ckpt / "state.json").is_file():
        first = int(booster.load_state(ckpt, model, optimizer, dataloader=loader)["step"]) + 1
        logger.warning("resumed from %s at step %d", ckpt, first)
    main = dist_rank() == 0
    writer = MetricsWriter.from_step(out / "metrics.jsonl", first) if main else None
    _, _, group = dp_info(booster)
    bar = _bar(config.steps, first) if progress and main else None
    stream = _batches(loader)
    micro_step = pipeline_step or functools.partial(_micro, loss_fn=loss_fn)
    rows: list[dict[str, float]] = []
    for step in range(first, config.steps):
        sums: dict[str, float] = {}
        for micro in range(config.grad_accum):
            batch = next(stream)
            if micro < config.grad_accum - 1:
                with booster.no_sync(model, optimizer):
                    metrics = micro_step(booster, model, optimizer, batch, config.grad_accum)
            else:
                metrics = micro_step(booster, model, optimizer, batch, config.grad_accum)
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + v / config.grad_accum
        row = all_reduce_mean(sums, group)
        row["grad_norm"] = float(optimizer.clip_grad_by_norm(config.max_grad_norm))
        optimizer.step()
        optimizer.zero_grad()
        row["step"] = step
        rows.append(row)
        if writer is not None:
            writer.write(row)
        if bar is not None:
            bar.set_postfix_str(
                " ".join(f"{k} {v:.4f}" for k, v in row.items() if k != "step"), refresh=False
            )
            bar.update(1)
        last = step == config.steps - 1
        if (config.save_every and (step + 1) % config.save_every == 0) or (last and config.save_every):
            booster.save_state(ckpt, model, optimizer, dataloader=loader, step=step)
    if writer is not None:
        writer.close()
    if bar is not None:
        bar.close()
    return rows


def _micro(
    booster: Booster,
    model: nn.Module,
    optimizer: Any,
    batch: dict[str, torch.Tensor],
    accum: int,
    loss_fn: LossFn,
) -> dict[str, float]:
    loss, metrics = loss_fn(model, batch)
    booster.backward(loss / accum, optimizer)
    return {"loss": float(loss.detach()), **metrics}


def _bar(total: int, initial: int) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)
