"""The two training loops of the equivalence tests: a plain single-process reference over the whole
global batch, and a boosted run on one rank's slice of it. Both take `steps × accum` global batches
(`synthetic_batches`), scale each micro-batch loss by 1/accum and optionally clip the global norm,
so a plugin that reduces, shards and clips correctly ends at the reference's parameters."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
from torch import nn

from megalith.testing.models import lm_loss


def reference_steps(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    batches: list[torch.Tensor],
    accum: int = 1,
    clip: float | None = None,
) -> None:
    """Plain torch on the whole global batches: backward of loss/accum per micro-batch, clip, step."""
    for step in range(len(batches) // accum):
        for micro in range(accum):
            (lm_loss(model, batches[step * accum + micro]) / accum).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()


def boosted_steps(
    booster: Any,
    model: nn.Module,
    opt: Any,
    batches: list[torch.Tensor],
    rank: int,
    world: int,
    accum: int = 1,
    clip: float | None = None,
) -> None:
    """The same through a Booster on rows `[rank·B/world, (rank+1)·B/world)` of every global batch;
    all but the last micro-batch of a step run under `no_sync`."""
    per_rank = batches[0].shape[0] // world
    for step in range(len(batches) // accum):
        for micro in range(accum):
            ids = batches[step * accum + micro][rank * per_rank : (rank + 1) * per_rank]
            with booster.no_sync(model, opt) if micro < accum - 1 else nullcontext():
                booster.backward(lm_loss(model, ids) / accum, opt)
        if clip is not None:
            opt.clip_grad_by_norm(clip)
        opt.step()
        opt.zero_grad()
