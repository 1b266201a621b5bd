"""`ZeroPlugin`: megalith's own ZeRO stage 1/2/3 over the data-parallel group."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megalith.booster.plugins.base import (
    Boosted,
    MemoryPlan,
    Plugin,
    fp32_snapshot,
    optimizer_names,
    replicated,
    unique_state,
)
from megalith.booster.precision import Precision
from megalith.common.device import get_device
from megalith.common.errors import CheckpointError, ConfigError
from megalith.optim import BoostedOptimizer
from megalith.zero import ZeroConfig, ZeroOptimizer
from megalith.zero.lazy import deterministic_values
from megalith.zero.stage3_optim import Zero3Optimizer


class ZeroPlugin(Plugin):
    """ZeRO (Rajbhandari et al. 2020). The model is not wrapped: parameters become views of flat
    buckets and the returned optimizer owns gradient reduction, the sharded update and the all-gather.

    `ZeroPlugin(stage=2, bucket_size_mb=25, overlap_communication=True, cpu_offload=False)` or
    `ZeroPlugin(config=ZeroConfig(...))`. Stage 3 also shards the parameters (hooks on the model
    gather them per module group); a model built on the meta device is materialised shard by shard
    with `deterministic_init`'s values (seed `init_seed`).
    """

    name = "zero"

    def __init__(self, stage: int = 2, config: ZeroConfig | None = None, **kwargs: object) -> None:
        self.config = config or ZeroConfig(stage=stage, **kwargs)  # type: ignore[arg-type]
        self.name = f"zero{self.config.stage}"
        self._group: dist.ProcessGroup | None = None
        self._stage3: dict[int, Zero3Optimizer] = {}

    @property
    def sharded_params(self) -> bool:  # type: ignore[override]
        return self.config.stage == 3

    @property
    def supports_bf16_true(self) -> bool:  # type: ignore[override]
        return self.config.stage < 3

    def configure(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None, precision: Precision
    ) -> Boosted:
        if optimizer is None:
            raise ConfigError("ZeroPlugin needs an optimizer: it shards the optimizer's states")
        names = optimizer_names(model, optimizer)
        lazy = any(p.is_meta for p in names)
        if lazy and self.config.stage != 3:
            raise ConfigError("a model on the meta device needs ZeroPlugin(stage=3) (lazy init)")
        if self.config.stage == 3:
            return self._configure_stage3(model, optimizer, precision, names, lazy)
        if self.dp_size() == 1 and not self.config.cpu_offload:
            # One rank: nothing to shard or reduce. The parameters stay ordinary tensors (no flat
            # buckets, so torch.compile sees plain parameters) and the optimizer steps them or their
            # masters directly — the model states ZeRO-1/2 hold at N = 1, without the copies.
            return Boosted(model, replicated(model, optimizer, precision))
        if dist.is_initialized() and dist.get_world_size() > 1:
            _broadcast_params(model)
        fp32 = fp32_snapshot(model) if precision.mixed else {}
        model.to(precision.dtype)
        zero = ZeroOptimizer(
            optimizer, names, self.config, self._group, precision.make_scaler(), precision.master_dtype
        )
        if precision.mixed:
            zero.load_master_values(lambda name, s, e: fp32[name].view(-1)[s:e])
        return Boosted(model, zero)

    def _configure_stage3(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        precision: Precision,
        names: dict[nn.Parameter, str],
        lazy: bool,
    ) -> Boosted:
        if lazy:
            device = get_device("auto").torch
            for p in names:
                if p.is_floating_point():
                    p.data = torch.empty(p.shape, dtype=precision.dtype, device="meta")
        else:
            device = next(iter(names)).device
            if dist.is_initialized() and dist.get_world_size() > 1:
                _broadcast_params(model)
        fp32 = fp32_snapshot(model) if precision.mixed and not lazy else {}
        if not lazy:
            model.to(precision.dtype)
        zero = Zero3Optimizer(
            optimizer, model, names, self.config, self._group, precision.make_scaler(), device
        )
        if lazy:
            _materialise_shards(model, zero, self.config.init_seed, device)
        elif precision.mixed:
            zero.load_master_values(lambda name, s, e: fp32[name].view(-1)[s:e])
        self._stage3[id(model)] = zero
        return Boosted(model, zero)

    @contextmanager
    def full_parameters(self, model: nn.Module) -> Iterator[None]:
        """Stage 3: every parameter gathered in full on every rank inside the block (a collective)."""
        zero = self._stage3.get(id(model))
        if zero is None:
            yield
            return
        with zero.sharder.gathered():
            yield

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        return self._group

    # -- checkpoints: stage 3 never holds the full model on one rank ---------------------------------
    def export_state(self, model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        """Stage 3: gathers one module group at a time (a collective: every rank iterates to the end)."""
        zero = self._stage3.get(id(model))
        if zero is None:
            yield from super().export_state(model)
            return
        params = {id(slot.param) for u in zero.units for seg in u.segments for slot in seg.slots}
        for unit in zero.units:
            zero.sharder.gather(unit)
            try:
                for seg in unit.segments:
                    for slot in seg.slots:
                        yield slot.name, slot.param.detach().clone()
            finally:
                zero.sharder.release(unit)
        for name, t in unique_state(model).items():
            if id(t) not in params:
                yield name, t.detach()

    def model_pieces(self, model: nn.Module) -> list[tuple[str, int, int, torch.Tensor]]:
        zero = self._stage3.get(id(model))
        if zero is None:
            return super().model_pieces(model)
        out = []
        for unit in zero.units:
            for seg in unit.segments:
                for ref in seg.pieces():
                    n = ref.end - ref.start
                    out.append((ref.name, ref.start, ref.end, seg.shard[ref.offset : ref.offset + n]))
        if not dist.is_initialized() or dist.get_rank() == 0:
            out += [(n, 0, t.numel(), t.detach().reshape(-1)) for n, t in _buffers(model, zero).items()]
        return out

    def load_model_pieces(self, model: nn.Module, optimizer: BoostedOptimizer | None, reader: Any) -> None:
        zero = self._stage3.get(id(model))
        if zero is None:
            super().load_model_pieces(model, optimizer, reader)
            return
        wanted = {s.name for u in zero.units for seg in u.segments for s in seg.slots}
        missing = sorted((wanted | set(_buffers(model, zero))) - reader.names())
        if missing:
            raise CheckpointError(f"checkpoint {reader.directory} has no tensor {missing[0]!r}")
        with torch.no_grad():
            for unit in zero.units:
                for seg in unit.segments:
                    for ref in seg.pieces():
                        n = ref.end - ref.start
                        seg.shard[ref.offset : ref.offset + n].copy_(
                            reader.read(ref.name, ref.start, ref.end)
                        )
            for name, t in _buffers(model, zero).items():
                t.copy_(reader.read(name, 0, t.numel()).view(t.shape))
        zero.load_masters_from_model()

    def memory_plan(
        self, num_params: int, num_trainable: int, world_size: int, precision: Precision
    ) -> MemoryPlan:
        """mixed Adam: ZeRO-1 2Φ + 2Ψ + 12Ψ/N, ZeRO-2 2Φ + 2Ψ/N + 12Ψ/N; fp32: 4Φ + 4Ψ + 8Ψ/N, 4Φ + 12Ψ/N.

        (Φ = all parameters, Ψ = trainable ones; with everything trainable these are the paper's
        16Ψ-family formulas.) cpu_offload moves the optimizer states (and fp32 masters) to the host.
        Stage 3: see `_stage3_plan`."""
        if self.config.stage == 3:
            return _stage3_plan(self.name, self.config, num_params, num_trainable, world_size, precision)
        b, n, psi = precision.param_bytes, world_size, num_trainable
        master = 4 if precision.mixed else b if self.config.cpu_offload else 0  # a separate copy, if any
        states = (2 * precision.state_bytes + master) * psi // n
        grads = b * psi if self.config.stage == 1 else b * psi // n
        return MemoryPlan(
            plugin=self.name,
            precision=precision.name,
            world_size=world_size,
            num_params=num_params,
            num_trainable=num_trainable,
            params=b * num_params,
            grads=grads,
            optimizer_states=0 if self.config.cpu_offload else states,
            host=states if self.config.cpu_offload else 0,
        )


def _stage3_plan(
    name: str, config: ZeroConfig, phi: int, psi: int, n: int, precision: Precision
) -> MemoryPlan:
    """ZeRO-3: everything divided by N — params bΦ/N, fp32 gradient shards 4Ψ/N, Adam 8Ψ/N, plus an
    fp32 master 4Ψ/N where it cannot be the parameter shard itself (mixed precision, or parameter
    and optimizer placed apart). fp32 with nothing offloaded: the paper's 16Ψ/N. Offloaded fractions
    (fo of the optimizer side, fp of the parameter shards) are counted in `host`."""
    b = precision.param_bytes
    fo, fp = config.optim_offload_fraction, config.offload_param_frac
    params = b * phi / n
    grads, adam = 4 * psi / n, 8 * psi / n
    if precision.mixed:
        master_dev, master_host = 4 * psi / n * (1 - fo), 4 * psi / n * fo
    else:  # separate master only where the two placements differ; it lives with the optimizer
        master_dev, master_host = 4 * psi / n * max(fp - fo, 0), 4 * psi / n * max(fo - fp, 0)
    host = params * fp + (grads + adam) * fo + master_host
    return MemoryPlan(
        plugin=name,
        precision=precision.name,
        world_size=n,
        num_params=phi,
        num_trainable=psi,
        params=round(params * (1 - fp)),
        grads=round(grads * (1 - fo)),
        optimizer_states=round(adam * (1 - fo) + master_dev),
        host=round(host),
    )


def _materialise_shards(model: nn.Module, zero: Zero3Optimizer, seed: int, device: torch.device) -> None:
    """Lazy init: fill this rank's shards (and fp32 masters, exactly) from `deterministic_values`
    (generated in fp32), one module at a time."""
    where = {s.name: (seg, s) for unit in zero.units for seg in unit.segments for s in seg.slots}
    master_of = {id(seg): m for seg, m in zip(zero.segments, zero.masters, strict=True)}
    with torch.no_grad():
        for name, _, value in deterministic_values(model, seed, device, dtype=torch.float32):
            seg, slot = where[name]
            lo, hi = seg.shard_range
            a, b = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
            if a >= b:
                continue
            part = value.reshape(-1)[a - slot.offset : b - slot.offset]
            seg.shard[a - lo : b - lo].copy_(part)
            master = master_of.get(id(seg))
            if master is not None and master is not seg.shard:
                master.view(-1)[a - lo : b - lo].copy_(part)


def _buffers(model: nn.Module, zero: Zero3Optimizer) -> dict[str, torch.Tensor]:
    params = {id(slot.param) for u in zero.units for seg in u.segments for slot in seg.slots}
    return {n: t for n, t in unique_state(model).items() if id(t) not in params}


def _broadcast_params(model: nn.Module) -> None:
    """Start every rank from rank 0's weights (DDP does the same at construction)."""
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            dist.broadcast(t.data, src=0)
