"""`DDPPlugin`: torch DistributedDataParallel (all-reduce of gradient buckets) with megalith's verbs."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from megalith.booster.plugins.base import Boosted, MemoryPlan, Plugin, replicated
from megalith.booster.precision import Precision
from megalith.common.errors import ConfigError
from megalith.common.validate import check_bool, check_positive
from megalith.optim import BoostedOptimizer


@dataclass(frozen=True)
class DDPConfig:
    """bucket_cap_mb: size bound of one gradient bucket DDP all-reduces (a number > 0).
    find_unused_parameters / broadcast_buffers: torch DDP's flags of the same names (bools)."""

    bucket_cap_mb: float = 25.0
    find_unused_parameters: bool = False
    broadcast_buffers: bool = True

    def __post_init__(self) -> None:
        check_positive("bucket_cap_mb", self.bucket_cap_mb)
        check_bool("find_unused_parameters", self.find_unused_parameters)
        check_bool("broadcast_buffers", self.broadcast_buffers)


class DDPPlugin(Plugin):
    """Every rank holds the full model and optimizer; gradients are averaged by DDP's all-reduce.

    In a single process the model is not wrapped at all.
    """

    name = "ddp"
    supports_bf16_true = True

    def __init__(self, config: DDPConfig | None = None, **kwargs: object) -> None:
        if config is not None and not isinstance(config, DDPConfig):
            raise ConfigError(f"DDPPlugin(config=...) needs a DDPConfig, got {config!r}")
        if config is not None and kwargs:
            raise ConfigError(f"DDPPlugin takes a config or keyword options, not both: got {sorted(kwargs)}")
        self.config = config or DDPConfig(**kwargs)  # type: ignore[arg-type]

    def configure(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None, precision: Precision
    ) -> Boosted:
        wrapped = replicated(model, optimizer, precision)
        if dist.is_initialized() and dist.get_world_size() > 1:
            device_ids = [torch.cuda.current_device()] if next(model.parameters()).is_cuda else None
            model = DDP(
                model,
                device_ids=device_ids,
                bucket_cap_mb=self.config.bucket_cap_mb,
                find_unused_parameters=self.config.find_unused_parameters,
                gradient_as_bucket_view=True,
                # only passed when turned off: the keyword is deprecated in recent torch
                **({} if self.config.broadcast_buffers else {"broadcast_buffers": False}),  # type: ignore[arg-type]
            )
        return Boosted(model, wrapped)

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module if isinstance(model, DDP) else model

    @contextmanager
    def no_sync(self, model: nn.Module | None, optimizer: BoostedOptimizer | None) -> Iterator[None]:
        with ExitStack() as stack:
            if isinstance(model, DDP):
                stack.enter_context(model.no_sync())
            if optimizer is not None:
                stack.enter_context(optimizer.no_sync())
            yield

    def memory_plan(
        self, num_params: int, num_trainable: int, world_size: int, precision: Precision
    ) -> MemoryPlan:
        b = precision.param_bytes
        master = 4 * num_trainable if precision.mixed else 0
        return MemoryPlan(
            plugin=self.name,
            precision=precision.name,
            world_size=world_size,
            num_params=num_params,
            num_trainable=num_trainable,
            params=b * num_params,
            grads=b * num_trainable,
            optimizer_states=2 * precision.state_bytes * num_trainable + master,
        )
