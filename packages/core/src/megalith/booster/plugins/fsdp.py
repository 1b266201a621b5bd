"""`FSDPPlugin`: torch's FSDP2 (`fully_shard`) behind megalith's verbs — the torch-native ZeRO-3.

Modules are sharded in the same groups ZeRO-3 uses (`megalith.zero.group_parameters`: size-bounded,
tied parameters at their lowest common ancestor), the root last. Every parameter becomes a DTensor
sharded on dim 0 over dp; FSDP2 all-gathers per group before forward/backward and reduce-scatters
(mean) gradients. `MixedPrecisionPolicy(param_dtype=bf16|fp16, reduce_dtype=fp32)` for mixed
precision (the sharded parameters stay fp32: they are the masters); `CPUOffloadPolicy` with
`cpu_offload=True`.

The optimizer wrapper steps the *local* shards (plain tensors sharing the DTensors' storage), so
clipping is a sum of squares over disjoint shards all-reduced over dp, and `owned()` is exact:
rank r's shard of a dim-0-sharded parameter of shape [d0, ...] holds rows [r·c, r·c + rows_r)
with c = ceil(d0 / N), i.e. the flattened range [r·c·row, r·c·row + local.numel()).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megalith.booster.plugins.base import Boosted, MemoryPlan, Plugin, unique_state
from megalith.booster.precision import Precision
from megalith.common.errors import CheckpointError, ConfigError
from megalith.common.validate import check_bool, check_positive
from megalith.optim import BoostedOptimizer, DynamicLossScaler, PieceRef
from megalith.zero import named_parameter_map
from megalith.zero.stage3_layout import group_parameters


@dataclass(frozen=True)
class FSDPConfig:
    """group_size_mb: a module whose not-yet-grouped parameters reach this size is its own FSDP group.
    reshard_after_forward: free gathered parameters after forward (ZeRO-3); False keeps them to backward.
    cpu_offload: sharded parameters, gradients and optimizer step on the host (CPUOffloadPolicy)."""

    group_size_mb: float = 25.0
    reshard_after_forward: bool = True
    cpu_offload: bool = False

    def __post_init__(self) -> None:
        check_positive("group_size_mb", self.group_size_mb)
        check_bool("reshard_after_forward", self.reshard_after_forward)
        check_bool("cpu_offload", self.cpu_offload)


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


class FSDPOptimizer(BoostedOptimizer):
    sharded_grads = True
    replicated = False

    def __init__(
        self,
        optim: torch.optim.Optimizer,
        params: dict[str, nn.Parameter],
        dp_group: dist.ProcessGroup | None,
        scaler: DynamicLossScaler | None,
    ) -> None:
        super().__init__(optim, scaler)
        self.norm_group = dp_group
        self.dp_size = dist.get_world_size(dp_group) if dist.is_initialized() else 1
        self.dp_rank = dist.get_rank(dp_group) if dist.is_initialized() else 0
        self.names = list(params)
        self.params = list(params.values())
        self.locals = [_local(p.detach()) for p in self.params]  # share storage with the shards
        self._local_of = {id(p): m for p, m in zip(self.params, self.locals, strict=True)}

    def repoint(self, old_to_name: dict[nn.Parameter, str]) -> None:
        index = {n: i for i, n in enumerate(self.names)}
        for group in self.optim.param_groups:
            group["params"] = [
                self.locals[index[old_to_name[p]]] for p in group["params"] if old_to_name[p] in index
            ]

    def _master_grads(self) -> list[torch.Tensor]:
        if not self._prepared:
            for p, m in zip(self.params, self.locals, strict=True):
                m.grad = None if p.grad is None else _local(p.grad)
        return [m.grad for m in self.locals if m.grad is not None]

    def _zero_grad(self) -> None:
        for p, m in zip(self.params, self.locals, strict=True):
            p.grad = None
            m.grad = None

    def param_numels(self) -> dict[str, int]:
        return {name: p.numel() for name, p in zip(self.names, self.params, strict=True)}  # DTensor: full

    def master_names(self) -> dict[int, list[str]]:
        return {id(m): [name] for name, m in zip(self.names, self.locals, strict=True)}

    def owned(self) -> list[tuple[torch.Tensor, list[PieceRef]]]:
        out: list[tuple[torch.Tensor, list[PieceRef]]] = []
        for name, p, m in zip(self.names, self.params, self.locals, strict=True):
            if m.numel() == 0:
                out.append((m, []))
                continue
            start = _shard_start(p, self.dp_rank, self.dp_size) if hasattr(p, "to_local") else 0
            out.append((m, [PieceRef(name, start, start + m.numel(), 0)]))
        return out

    def memory_bytes(self) -> dict[str, int]:
        states = sum(
            t.numel() * t.element_size()
            for m in self.locals
            for t in self.optim.state.get(m, {}).values()
            if isinstance(t, torch.Tensor) and t.numel() > 1
        )
        grads = sum(_local(p.grad).numel() * 4 for p in self.params if p.grad is not None)
        return {"grads": grads, "optimizer_states": states}


class FSDPPlugin(Plugin):
    name = "fsdp"
    sharded_params = True

    def __init__(self, config: FSDPConfig | None = None, **kwargs: Any) -> None:
        self.config = config or FSDPConfig(**kwargs)
        self._group: dist.ProcessGroup | None = None

    def configure(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None, precision: Precision
    ) -> Boosted:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        if not dist.is_initialized():
            raise ConfigError("FSDPPlugin needs an initialised process group (launch() under torchrun)")
        old = named_parameter_map(model)
        mp = MixedPrecisionPolicy(
            param_dtype=precision.dtype if precision.mixed else None, reduce_dtype=torch.float32
        )
        kwargs: dict[str, Any] = {"mp_policy": mp, "reshard_after_forward": self.config.reshard_after_forward}
        if self.config.cpu_offload:
            kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
        for module in _groups(model, old, int(self.config.group_size_mb * 2**20) // 4):
            fully_shard(module, **kwargs)
        fully_shard(model, **kwargs)
        wrapped = None
        if optimizer is not None:
            params = {n: p for n, p in model.named_parameters() if p.requires_grad}
            wrapped = FSDPOptimizer(optimizer, params, self._group, precision.make_scaler())
            wrapped.repoint(old)
        return Boosted(model, wrapped)

    @contextmanager
    def no_sync(self, model: nn.Module | None, optimizer: BoostedOptimizer | None) -> Iterator[None]:
        setter = getattr(model, "set_requires_gradient_sync", None)
        with ExitStack() as stack:
            if setter is not None:
                setter(False)
                stack.callback(setter, True)
            if optimizer is not None:
                stack.enter_context(optimizer.no_sync())
            yield

    def export_state(self, model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, full tensor) per state-dict entry, tied parameters once (DTensor.full_tensor():
        a collective, every rank iterates to the end)."""
        for name, t in unique_state(model).items():
            full = t.full_tensor() if hasattr(t, "full_tensor") else t
            yield name, full.detach()

    def model_pieces(self, model: nn.Module) -> list[tuple[str, int, int, torch.Tensor]]:
        rank0 = dist.get_rank() == 0
        out = []
        for name, t in unique_state(model).items():
            if hasattr(t, "to_local"):
                local = _local(t.detach())
                start = _shard_start(t, dist.get_rank(self._group), dist.get_world_size(self._group))
                if local.numel():
                    out.append((name, start, start + local.numel(), local.reshape(-1)))
            elif rank0:
                out.append((name, 0, t.numel(), t.detach().reshape(-1)))
        return out

    def load_model_pieces(self, model: nn.Module, optimizer: BoostedOptimizer | None, reader: Any) -> None:
        state = unique_state(model)
        missing = sorted(set(state) - reader.names())
        if missing:
            raise CheckpointError(f"checkpoint {reader.directory} has no tensor {missing[0]!r}")
        rank, world = dist.get_rank(self._group), dist.get_world_size(self._group)
        with torch.no_grad():
            for name, t in state.items():
                target = _local(t.detach())
                start = _shard_start(t, rank, world) if hasattr(t, "to_local") else 0
                if target.numel():
                    target.copy_(reader.read(name, start, start + target.numel()).view(target.shape))

    def memory_plan(
        self, num_params: int, num_trainable: int, world_size: int, precision: Precision
    ) -> MemoryPlan:
        """fp32 sharded params 4Φ/N (the masters, also under mixed precision), fp32 grads 4Ψ/N, Adam 8Ψ/N."""
        n = world_size
        host = self.config.cpu_offload
        params, grads, states = 4 * num_params // n, 4 * num_trainable // n, 8 * num_trainable // n
        return MemoryPlan(
            plugin=self.name,
            precision=precision.name,
            world_size=n,
            num_params=num_params,
            num_trainable=num_trainable,
            params=0 if host else params,
            grads=0 if host else grads,
            optimizer_states=0 if host else states,
            host=params + grads + states if host else 0,
        )


def _shard_start(t: torch.Tensor, rank: int, world: int) -> int:
    """Flat offset of rank `rank`'s dim-0 shard: rows [r·c, ...) with c = ceil(d0 / N)."""
    rows = t.shape[0] if t.dim() else 1
    return min(rank * -(-rows // world), rows) * (t.numel() // max(rows, 1))


def _groups(model: nn.Module, names: dict[nn.Parameter, str], min_numel: int) -> list[nn.Module]:
    """ZeRO-3's module groups (bottom-up, root excluded) whose parameters are exactly what
    `fully_shard(module)` would claim — so tied parameters stay in their common ancestor's group."""
    claimed: set[nn.Parameter] = set()
    out = []
    for path, module, params in group_parameters(model, names, min_numel):
        if path == "":
            continue
        subtree = {p for p in module.parameters() if p not in claimed}
        if subtree == set(params):
            out.append(module)
            claimed |= subtree
    return out
