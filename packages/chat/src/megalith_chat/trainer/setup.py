"""Booster, optimizer and data-parallel helpers shared by every trainer."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megalith.booster import Booster
from megalith.booster.plugins import DDPPlugin, ZeroPlugin
from megalith.common.errors import ConfigError
from megalith_chat.trainer.parallel import hybrid_plugin

PLUGINS = ("ddp", "zero1", "zero2")
PRECISIONS = ("fp32", "bf16", "fp16", "bf16-true")


def make_booster(
    plugin: str = "zero2",
    precision: str = "fp32",
    tp: int = 1,
    sp_mode: str = "none",
    model: nn.Module | None = None,
    pipeline: dict[str, Any] | None = None,
) -> Booster:
    """``ddp`` | ``zero1`` | ``zero2`` with ``fp32`` | ``bf16`` | ``fp16`` | ``bf16-true``; with ``tp > 1`` or a
    ``pipeline`` (HybridPlugin pp options, trainer/pp.py) the hybrid plugin (tensor parallel over tp,
    pipeline stages over pp, ``plugin`` over dp; see trainer/parallel.py), which needs the ``model``
    for its plan."""
    if plugin not in PLUGINS:
        raise ConfigError(f"unknown plugin {plugin!r}; expected one of {PLUGINS}")
    if precision not in PRECISIONS:
        raise ConfigError(f"unknown precision {precision!r}; expected one of {PRECISIONS}")
    if tp > 1 or pipeline:
        if model is None:
            raise ConfigError(f"make_booster(tp={tp}, pipeline={pipeline}) needs the model (its plan)")
        return Booster(plugin=hybrid_plugin(model, plugin, tp, sp_mode, pipeline), precision=precision)
    chosen = DDPPlugin() if plugin == "ddp" else ZeroPlugin(stage=int(plugin[-1]))
    return Booster(plugin=chosen, precision=precision)


def make_optimizer(model: nn.Module, lr: float, weight_decay: float = 0.0) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters (``requires_grad``; LoRA adapters only under peft)."""
    if not lr > 0 or not math.isfinite(lr):
        raise ConfigError(f"learning rate must be a positive number, got {lr}")
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ConfigError("the model has no trainable parameters")
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=(0.9, 0.99), eps=1e-8)


def dp_info(booster: Booster) -> tuple[int, int, Any]:
    """``(dp_rank, dp_size, dp_group)``; the group is ``None`` (the default group) or the plugin's."""
    if not dist.is_initialized():
        return 0, 1, None
    group = booster.plugin.dp_group
    return dist.get_rank(group), dist.get_world_size(group), group


def shard_bounds(total: int, rank: int, world: int, what: str = "samples") -> tuple[int, int]:
    """Contiguous equal shard ``[start, stop)`` of ``total`` rows; ``total`` must divide evenly."""
    if total % world != 0:
        raise ConfigError(f"{total} {what} cannot be split evenly over {world} data-parallel ranks")
    per = total // world
    return rank * per, (rank + 1) * per


def all_reduce_mean(values: dict[str, float], group: Any) -> dict[str, float]:
    """Average scalar metrics over the data-parallel group (identity in one process)."""
    if not dist.is_initialized() or not values:
        return dict(values)
    keys = sorted(values)
    t = torch.tensor([values[k] for k in keys], dtype=torch.float64)
    dist.all_reduce(t, group=group)
    t /= dist.get_world_size(group)
    return {k: float(v) for k, v in zip(keys, t)}
