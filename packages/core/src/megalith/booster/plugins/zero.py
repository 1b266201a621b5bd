"""`ZeroPlugin`: megalith's own ZeRO stage 1/2 over the data-parallel group."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from megalith.booster.plugins.base import Boosted, MemoryPlan, Plugin, fp32_snapshot
from megalith.booster.precision import Precision
from megalith.common.errors import ConfigError
from megalith.zero import ZeroConfig, ZeroOptimizer, named_parameter_map


class ZeroPlugin(Plugin):
    """ZeRO (Rajbhandari et al. 2020). The model is not wrapped: parameters become views of flat
    buckets and the returned optimizer owns gradient reduction, the sharded update and the all-gather.

    `ZeroPlugin(stage=2, bucket_size_mb=25, overlap_communication=True, cpu_offload=False)` or
    `ZeroPlugin(config=ZeroConfig(...))`.
    """

    name = "zero"

    def __init__(self, stage: int = 2, config: ZeroConfig | None = None, **kwargs: object) -> None:
        self.config = config or ZeroConfig(stage=stage, **kwargs)  # type: ignore[arg-type]
        self.name = f"zero{self.config.stage}"
        self._group: dist.ProcessGroup | None = None

    def configure(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None, precision: Precision
    ) -> Boosted:
        if optimizer is None:
            raise ConfigError("ZeroPlugin needs an optimizer: it shards the optimizer's states")
        names = named_parameter_map(model)
        unknown = [p for g in optimizer.param_groups for p in g["params"] if p not in names]
        if unknown:
            raise ConfigError(f"optimizer holds {len(unknown)} parameter(s) that are not in the model")
        if dist.is_initialized() and dist.get_world_size() > 1:
            _broadcast_params(model)
        fp32 = fp32_snapshot(model) if precision.mixed else {}
        model.to(precision.dtype)
        zero = ZeroOptimizer(optimizer, names, self.config, self._group, precision.make_scaler())
        if precision.mixed:
            zero.load_master_values(lambda name, s, e: fp32[name].view(-1)[s:e])
        return Boosted(model, zero)

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        return self._group

    def memory_plan(
        self, num_params: int, num_trainable: int, world_size: int, precision: Precision
    ) -> MemoryPlan:
        """mixed Adam: ZeRO-1 2Φ + 2Ψ + 12Ψ/N, ZeRO-2 2Φ + 2Ψ/N + 12Ψ/N; fp32: 4Φ + 4Ψ + 8Ψ/N, 4Φ + 12Ψ/N.

        (Φ = all parameters, Ψ = trainable ones; with everything trainable these are the paper's
        16Ψ-family formulas.) cpu_offload moves the optimizer states (and fp32 masters) to the host."""
        b, n, psi = precision.param_bytes, world_size, num_trainable
        master = 4 if (precision.mixed or self.config.cpu_offload) else 0
        states = (8 + master) * psi // n
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


def _broadcast_params(model: nn.Module) -> None:
    """Start every rank from rank 0's weights (DDP does the same at construction)."""
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            dist.broadcast(t.data, src=0)
