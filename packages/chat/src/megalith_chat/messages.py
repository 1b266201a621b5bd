"""Messages exchanged between rollout producers and the trainer (consumer).

Frozen dataclasses, never bare tuples: every message says what it is, and a malformed batch is
rejected where it is built (shapes checked in ``__post_init__``), not where it is consumed.

Layout of a :class:`RolloutBatch` with ``B = num_prompts * group_size`` samples (the ``G``
samples of one prompt contiguous, as :mod:`megalith_chat.algorithms.advantages` expects):

* ``prompt_ids``  ``[B, P]`` long, left-padded; ``prompt_mask`` ``[B, P]`` (1 = real token)
* ``response_ids`` ``[B, R]`` long, right-padded; ``response_mask`` ``[B, R]``
* ``rollout_logprobs`` ``[B, R]`` float: log-probs the inference engine sampled with (for TIS)
* ``rewards`` ``[B]`` float: scalar outcome rewards
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megalith.common.errors import DataError


@dataclass(frozen=True)
class RolloutBatch:
    """Producer -> trainer: one batch of sampled responses with rewards (see module docstring)."""

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    response_ids: torch.Tensor
    response_mask: torch.Tensor
    rollout_logprobs: torch.Tensor
    rewards: torch.Tensor
    group_size: int
    weight_version: int
    producer_id: int
    reward_errors: int = 0  # reward calls that raised or timed out (scored 0)
    metrics: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        batch = self.prompt_ids.shape[0]
        expected = {
            "prompt_ids": (batch, self.prompt_ids.shape[-1]),
            "prompt_mask": tuple(self.prompt_ids.shape),
            "response_ids": (batch, self.response_ids.shape[-1]),
            "response_mask": tuple(self.response_ids.shape),
            "rollout_logprobs": tuple(self.response_ids.shape),
            "rewards": (batch,),
        }
        for name, shape in expected.items():
            got = tuple(getattr(self, name).shape)
            if got != shape:
                raise DataError(f"RolloutBatch.{name} has shape {got}, expected {shape}")
        if self.group_size < 1 or batch % self.group_size != 0:
            raise DataError(f"RolloutBatch group_size={self.group_size} must divide the batch size {batch}")
        if self.weight_version < 0:
            raise DataError(f"RolloutBatch weight_version must be >= 0, got {self.weight_version}")

    @property
    def num_samples(self) -> int:
        return int(self.prompt_ids.shape[0])

    @property
    def num_prompts(self) -> int:
        return self.num_samples // self.group_size

    @property
    def num_response_tokens(self) -> int:
        return int(self.response_mask.sum())


@dataclass(frozen=True)
class WeightSyncRequest:
    """Trainer -> producers: new weights of ``version`` are about to be broadcast."""

    weight_version: int
    num_tensors: int
    num_bytes: int


@dataclass(frozen=True)
class WeightSyncDone:
    """Producer -> trainer: the producer now samples with weights of ``weight_version``."""

    producer_id: int
    weight_version: int
    seconds: float


@dataclass(frozen=True)
class ProducerFailed:
    """Producer -> trainer: the producer stopped; ``error`` says why (shown to the user)."""

    producer_id: int
    error: str


@dataclass(frozen=True)
class Shutdown:
    """Trainer -> producers: finish the current batch and exit."""

    reason: str = "training finished"
