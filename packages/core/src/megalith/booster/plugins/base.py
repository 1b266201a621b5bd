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
from megalith.checkpoint import unique_state
from megalith.common.errors import CheckpointError, ConfigError
from megalith.optim import BoostedOptimizer, ReplicatedOptimizer
from megalith.zero import named_parameter_map


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
    supports_bf16_true = False  # whether precision="bf16-true" (no fp32 masters) is implemented
    # True when parameters are sharded over dp (ZeRO-3, FSDP): checkpoints then go through
    # `export_state` / the sharded (DCP) model format instead of rank 0's `model.state_dict()`.
    sharded_params = False

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

    # -- model state for checkpoints (sharded plugins override all three) ---------------------------
    def export_state(self, model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, full tensor) per state-dict entry, tied tensors once. A collective for sharded
        plugins: every rank must iterate it to the end."""
        yield from unique_state(self.unwrap(model)).items()

    def model_pieces(self, model: nn.Module) -> list[tuple[str, int, int, torch.Tensor]]:
        """This rank's (name, start, end, flat values) of the model state for a sharded save.
        Replicated plugins: rank 0 holds (and writes) everything."""
        if dist.is_initialized() and dist.get_rank() != 0:
            return []
        return [
            (n, 0, t.numel(), t.detach().reshape(-1)) for n, t in unique_state(self.unwrap(model)).items()
        ]

    def load_model_pieces(self, model: nn.Module, optimizer: BoostedOptimizer | None, reader: Any) -> None:
        """Fill the model from `reader.read(name, start, end)` (any checkpoint layout)."""
        state = unique_state(self.unwrap(model))
        missing = sorted(set(state) - reader.names())
        if missing:
            raise CheckpointError(f"checkpoint {reader.directory} has no tensor {missing[0]!r}")
        with torch.no_grad():
            for name, t in state.items():
                t.copy_(reader.read(name, 0, t.numel()).view(t.shape))
        if optimizer is not None:
            optimizer.load_masters_from_model()


def fp32_snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    """fp32 copies of the trainable parameters by name, taken before a cast to low precision."""
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        if p.requires_grad and name not in out:
            out[name] = p.detach().float().clone()
    return out


def optimizer_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[nn.Parameter, str]:
    """The model's parameter → name map; ConfigError if the optimizer holds parameters outside it."""
    names = named_parameter_map(model)
    unknown = [p for g in optimizer.param_groups for p in g["params"] if p not in names]
    if unknown:
        raise ConfigError(f"optimizer holds {len(unknown)} parameter(s) that are not in the model")
    return names


def replicated(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, precision: Precision
) -> ReplicatedOptimizer | None:
    """Cast `model` to the precision's dtype and wrap `optimizer` for replicated parameters: fp32
    masters (starting from the exact fp32 values, not the rounded copies) under mixed precision."""
    names = optimizer_names(model, optimizer) if optimizer is not None else {}
    fp32 = fp32_snapshot(model) if precision.mixed else {}
    model.to(precision.dtype)
    if optimizer is None:
        return None
    wrapped = ReplicatedOptimizer(optimizer, names, precision.make_scaler(), masters=precision.mixed)
    if precision.mixed:
        wrapped.load_master_values(lambda name, s, e: fp32[name].view(-1)[s:e])
    return wrapped
