"""`PipelineEngine`: a model split over the ranks of one pipeline group, and one training step.

    batch  [B, ...] → m microbatches [B/m, ...] (every tensor of a dict split along dim 0)
    stages S = p·v, stage s on rank `schedule.stage_rank(s)`; layers balanced by parameter count
    loss   Σ_i criterion(y_i, mb_i) / m on the last stage, broadcast over the pipeline group

The engine owns no optimizer: gradients of the held parameters accumulate in `.grad`, and the
caller reduces them over dp and steps.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megalith.common.errors import ConfigError
from megalith.pipeline.executor import Criterion, PipelineExecutor
from megalith.pipeline.p2p import PipeP2P, Recv, Send
from megalith.pipeline.schedule import Schedule
from megalith.pipeline.schedules import make_schedule
from megalith.pipeline.stage import Microbatch, layer_costs, make_stages, prune, stage_ranges

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PipelineConfig:
    """pp_size ranks, `schedule` by name (see `megalith.pipeline.schedules.SCHEDULES`),
    `num_microbatches` per step, `num_model_chunks` v stages per rank (interleaved),
    `layers_per_stage` (p·v numbers) or None to balance by parameter count, and the ratio of each
    stage's layers whose activations are recomputed in backward."""

    pp_size: int = 1
    schedule: str = "1f1b"
    num_microbatches: int | None = None
    num_model_chunks: int = 1
    layers_per_stage: tuple[int, ...] | None = None
    checkpoint_ratio: float = 0.0

    def __post_init__(self) -> None:
        if self.pp_size < 1:
            raise ConfigError(f"pp_size must be >= 1, got {self.pp_size}")
        if self.num_model_chunks < 1:
            raise ConfigError(f"num_model_chunks must be >= 1, got {self.num_model_chunks}")
        if self.microbatches < self.pp_size:
            raise ConfigError(
                f"num_microbatches={self.microbatches} is fewer than the pipeline stages pp_size={self.pp_size}: "
                "every rank must get a microbatch"
            )
        if not 0.0 <= self.checkpoint_ratio <= 1.0:
            raise ConfigError(f"checkpoint_ratio must be in [0, 1], got {self.checkpoint_ratio}")

    @property
    def microbatches(self) -> int:
        return self.num_microbatches if self.num_microbatches is not None else self.pp_size

    @property
    def num_stages(self) -> int:
        return self.pp_size * self.num_model_chunks

    def make_schedule(self) -> Schedule:
        return make_schedule(self.schedule, self.pp_size, self.microbatches, self.num_model_chunks)


def split_microbatches(batch: Any, m: int) -> list[Microbatch]:
    """m microbatches of `batch` (a tensor or a mapping of tensors), split along dim 0."""
    if isinstance(batch, torch.Tensor):
        if batch.shape[0] % m:
            raise ConfigError(f"batch size {batch.shape[0]} is not divisible by num_microbatches={m}")
        return list(batch.chunk(m))
    if not isinstance(batch, Mapping):
        raise ConfigError(
            f"a pipeline batch must be a tensor or a dict of tensors, got {type(batch).__name__}"
        )
    parts: dict[str, Sequence[Any]] = {}
    for key, value in batch.items():
        if isinstance(value, torch.Tensor):
            if value.shape[0] % m:
                raise ConfigError(
                    f"batch[{key!r}] has {value.shape[0]} rows, not divisible by num_microbatches={m}"
                )
            parts[key] = value.chunk(m)
        else:
            parts[key] = [value] * m
    return [{k: v[i] for k, v in parts.items()} for i in range(m)]


class PipelineEngine:
    """Prunes `model` to this rank's stages and runs steps with `config`'s schedule over `group`."""

    def __init__(self, model: nn.Module, config: PipelineConfig, group: dist.ProcessGroup | None) -> None:
        self.config, self.group = config, group
        self.schedule = config.make_schedule()
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        size = dist.get_world_size(group) if dist.is_initialized() else 1
        if size != config.pp_size:
            raise ConfigError(f"pipeline group has {size} ranks, pp_size={config.pp_size}")
        self.ranges = stage_ranges(layer_costs(model), self.schedule.num_stages, config.layers_per_stage)
        self.held = self.schedule.stages_of(self.rank)
        self.stages = make_stages(model, self.ranges, self.held, config.checkpoint_ratio)
        prune(model, self.ranges, self.held)
        self.last_rank = self.schedule.stage_rank(self.schedule.num_stages - 1)
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        self.executor = PipelineExecutor(
            self.schedule, self.rank, self.stages, PipeP2P(group, device) if size > 1 else None
        )
        logger.info(
            "pipeline rank %d/%d: stages %s, layers %s, schedule %s, %d microbatches",
            self.rank,
            size,
            self.held,
            [list(self.ranges[s]) for s in self.held],
            config.schedule,
            config.microbatches,
        )

    def step(self, batch: Any, criterion: Criterion, loss_scale: float = 1.0) -> torch.Tensor:
        """Forward and backward of every microbatch of `batch`; returns the loss Σ_i ℓ_i on every
        rank of the pipeline group (broadcast from the rank holding the last stage)."""
        mbs = split_microbatches(batch, self.config.microbatches)
        return self._share_loss(self.executor.run(mbs, criterion, loss_scale))

    def forward_only(self, batch: Any, criterion: Criterion) -> torch.Tensor:
        """Σ_i criterion(y_i, mb_i) / m without backward (evaluation; call it under `torch.no_grad()`):
        each microbatch passes the stages in order (GPipe's forward half, for any v), activations
        travel on the training channels (non-blocking sends, blocking receives). Returns the loss on
        every rank of the pipeline group."""
        mbs = split_microbatches(batch, self.config.microbatches)
        comm, last = self.executor.comm, self.schedule.num_stages - 1
        total: torch.Tensor | None = None
        for mb in mbs:
            x: torch.Tensor | None = None
            for s in sorted(self.stages):
                prev = self.schedule.stage_rank(s - 1) if s > 0 else self.rank
                if prev != self.rank:  # else x is stage s−1's output, computed just before
                    assert comm is not None
                    (x,) = comm.exchange([], [Recv(prev, ("F", s - 1))])
                y = self.stages[s].forward(x, mb)
                if s == last:
                    loss = criterion(y, mb).detach() / len(mbs)
                    total = loss if total is None else total + loss
                elif self.schedule.stage_rank(s + 1) != self.rank:
                    assert comm is not None
                    comm.exchange([Send(y, self.schedule.stage_rank(s + 1), ("F", s))], [])
                x = y
        if comm is not None:
            comm.finish()
        return self._share_loss(total)

    def _share_loss(self, loss: torch.Tensor | None) -> torch.Tensor:
        """The last stage's loss, broadcast over the pipeline group (zeros elsewhere before)."""
        out = loss.detach().float().reshape(()) if loss is not None else torch.zeros(())
        if dist.is_initialized() and self.config.pp_size > 1:
            src = (
                dist.get_global_rank(self.group, self.last_rank) if self.group is not None else self.last_rank
            )
            out = out.clone()
            dist.broadcast(out, src=src, group=self.group)
        return out
