"""`plan()`: per-rank memory of model states for a plugin, computed without allocating anything."""

from __future__ import annotations

from torch import nn

from megalith.booster.plugins.base import MemoryPlan, Plugin
from megalith.booster.precision import Precision
from megalith.common.errors import ConfigError


def plan(model: nn.Module, plugin: Plugin, world_size: int, precision: str = "fp32") -> MemoryPlan:
    """Bytes of params, grads and Adam states per rank (ZeRO paper's accounting).

    Works on a model built on the meta device, so a model too large to allocate can be planned.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world_size must be a positive integer, got {world_size!r}")
    prec = Precision(precision)
    seen: set[int] = set()
    total = trainable = 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel()
        trainable += p.numel() if p.requires_grad else 0
    if total == 0:
        raise ConfigError(f"model {type(model).__name__} has no parameters")
    per_model = getattr(plugin, "model_memory_plan", None)  # plugins that count per parameter
    if per_model is not None:
        return per_model(model, world_size, prec)
    return plugin.memory_plan(total, trainable, world_size, prec)
