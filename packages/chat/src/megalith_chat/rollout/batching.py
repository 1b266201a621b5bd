"""Joining, slicing and buffering :class:`~megalith_chat.messages.RolloutBatch` messages.

A training step needs exactly ``prompts_per_step`` groups of ``G`` samples; producers deliver
batches of any number of groups, generated with possibly older weights. :class:`RolloutBuffer`
drops batches that are too stale (``trainer_version - batch.weight_version > max_staleness``),
keeps surplus groups for the next step, and hands out exact-size batches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from megalith.common.errors import ConfigError, DataError
from megalith_chat.messages import RolloutBatch


def _pad_to(t: torch.Tensor, width: int, value: float, left: bool) -> torch.Tensor:
    extra = width - t.shape[1]
    if extra == 0:
        return t
    pad = torch.full((t.shape[0], extra), value, dtype=t.dtype)
    return torch.cat([pad, t] if left else [t, pad], dim=1)


def concat_batches(batches: Sequence[RolloutBatch], pad_id: int = 0) -> RolloutBatch:
    """Stack batches with the same ``group_size`` (prompts re-left-padded, responses re-right-padded).

    The result carries the *oldest* ``weight_version``, the summed reward-error count and the
    first batch's producer id.
    """
    if not batches:
        raise DataError("concat_batches needs at least one batch")
    sizes = {b.group_size for b in batches}
    if len(sizes) != 1:
        raise DataError(f"cannot join rollout batches with different group sizes {sorted(sizes)}")
    p = max(b.prompt_ids.shape[1] for b in batches)
    r = max(b.response_ids.shape[1] for b in batches)

    def cat(name: str, width: int, value: float, left: bool) -> torch.Tensor:
        return torch.cat([_pad_to(getattr(b, name), width, value, left) for b in batches], dim=0)

    return RolloutBatch(
        prompt_ids=cat("prompt_ids", p, pad_id, True),
        prompt_mask=cat("prompt_mask", p, 0, True),
        response_ids=cat("response_ids", r, pad_id, False),
        response_mask=cat("response_mask", r, 0, False),
        rollout_logprobs=cat("rollout_logprobs", r, 0.0, False),
        rewards=torch.cat([b.rewards for b in batches]),
        group_size=batches[0].group_size,
        weight_version=min(b.weight_version for b in batches),
        producer_id=batches[0].producer_id,
        reward_errors=sum(b.reward_errors for b in batches),
        metrics=dict(batches[0].metrics),
    )


def select_groups(batch: RolloutBatch, start: int, stop: int) -> RolloutBatch:
    """Groups ``[start, stop)`` of a batch (rows ``start*G .. stop*G``)."""
    if not 0 <= start <= stop <= batch.num_prompts:
        raise ConfigError(f"group range [{start}, {stop}) outside 0..{batch.num_prompts}")
    g = batch.group_size
    rows = slice(start * g, stop * g)
    return replace(
        batch,
        prompt_ids=batch.prompt_ids[rows],
        prompt_mask=batch.prompt_mask[rows],
        response_ids=batch.response_ids[rows],
        response_mask=batch.response_mask[rows],
        rollout_logprobs=batch.rollout_logprobs[rows],
        rewards=batch.rewards[rows],
    )


def select_rows(batch: RolloutBatch, start: int, stop: int) -> dict[str, torch.Tensor]:
    """Rows ``[start, stop)`` of every per-sample tensor (a data-parallel shard or a micro-batch)."""
    names = ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "rollout_logprobs", "rewards")
    return {n: getattr(batch, n)[start:stop] for n in names}


class RolloutBuffer:
    """Accumulates producer batches and yields exactly ``groups_per_step`` groups per training step."""

    def __init__(self, groups_per_step: int, max_staleness: int, pad_id: int = 0) -> None:
        if groups_per_step < 1 or max_staleness < 0:
            raise ConfigError(
                f"need groups_per_step >= 1 and max_staleness >= 0, got {groups_per_step}, {max_staleness}"
            )
        self.groups_per_step = groups_per_step
        self.max_staleness = max_staleness
        self.pad_id = pad_id
        self._pending: list[RolloutBatch] = []
        self.dropped_stale = 0  # groups thrown away because their weights were too old

    @property
    def num_groups(self) -> int:
        return sum(b.num_prompts for b in self._pending)

    def _evict_stale(self, trainer_version: int) -> None:
        fresh = []
        for b in self._pending:
            if trainer_version - b.weight_version > self.max_staleness:
                self.dropped_stale += b.num_prompts
            else:
                fresh.append(b)
        self._pending = fresh

    def add(self, batch: RolloutBatch, trainer_version: int) -> None:
        self._pending.append(batch)
        self._evict_stale(trainer_version)

    def pop(self, trainer_version: int) -> RolloutBatch | None:
        """An exact-size batch if enough fresh groups are buffered, else ``None``."""
        self._evict_stale(trainer_version)
        if self.num_groups < self.groups_per_step:
            return None
        joined = concat_batches(self._pending, self.pad_id)
        out = select_groups(joined, 0, self.groups_per_step)
        rest = select_groups(joined, self.groups_per_step, joined.num_prompts)
        self._pending = [rest] if rest.num_prompts else []
        # the surplus keeps the oldest version of what it came from: conservative for staleness
        return out
