"""The `Plugin` ABC: one parallelism strategy behind the Booster's verbs."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megalith.booster.precision import Precision
from megalith.optim import BoostedOptimizer


@dataclass(frozen=True)
class MemoryPlan:
    """Per-rank bytes of model states (ZeRO paper's accounting; activations not included)."""

    plugin: str
    precision: str
    world_size: int
    num_params: int
    num_trainable: int
    params: int
    grads: int
    optimizer_states: int
    host: int = 0

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer_states

    def __str__(self) -> str:
        def gib(n: int) -> str:
            return f"{n / 2**30:9.3f} GiB"

        rows = [
            f"plan: {self.plugin}, {self.precision}, world_size={self.world_size}, "
            f"Ψ={self.num_trainable:,} trainable of {self.num_params:,} params",
            f"  params            {gib(self.params)}",
            f"  grads             {gib(self.grads)}",
            f"  optimizer states  {gib(self.optimizer_states)}",
            f"  total per rank    {gib(self.total)}",
        ]
        if self.host:
            rows.append(f"  host (offloaded)  {gib(self.host)}")
        return "\n".join(rows)


@dataclass(frozen=True)
class Boosted:
    model: nn.Module
    optimizer: BoostedOptimizer | None


class Plugin(ABC):
    """configure (wrap model / optimizer) → no_sync → unwrap; plus the per-rank memory formula."""

    name = "plugin"

    @abstractmethod
    def configure(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None, precision: Precision
    ) -> Boosted: ...

    @abstractmethod
    def memory_plan(
        self, num_params: int, num_trainable: int, world_size: int, precision: Precision
    ) -> MemoryPlan: ...

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        return None

    def dp_size(self) -> int:
        return dist.get_world_size(self.dp_group) if dist.is_initialized() else 1

    def dp_rank(self) -> int:
        return dist.get_rank(self.dp_group) if dist.is_initialized() else 0

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model

    @contextmanager
    def no_sync(self, model: nn.Module | None, optimizer: BoostedOptimizer | None) -> Iterator[None]:
        if optimizer is None:
            yield
            return
        with optimizer.no_sync():
            yield

    def describe(self) -> dict[str, Any]:
        return {"plugin": self.name}


def fp32_snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    """fp32 copies of the trainable parameters by name, taken before a cast to low precision."""
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        if p.requires_grad and name not in out:
            out[name] = p.detach().float().clone()
    return out
