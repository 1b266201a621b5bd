"""A distributed sampler whose position is part of the saved training state.

It shards over the data-parallel axis only: tp/pp/sp ranks of one dp rank see the same samples.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any

import torch
from torch.utils.data import DataLoader, Sampler

from megalith.common.errors import CheckpointError, ConfigError


class StatefulDistributedSampler(Sampler[int]):
    """Deterministic per-epoch permutation (seed + epoch), split round-robin over `num_replicas`.

    `state_dict()` holds the epoch and how many of this rank's samples were consumed, so a resumed
    run continues with exactly the next sample. Epochs advance automatically when exhausted.
    """

    def __init__(
        self,
        dataset: Sized,
        num_replicas: int = 1,
        rank: int = 0,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
    ) -> None:
        if not 0 <= rank < num_replicas:
            raise ConfigError(f"rank {rank} is outside [0, num_replicas={num_replicas})")
        self.dataset, self.num_replicas, self.rank = dataset, num_replicas, rank
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        n = len(dataset)
        if n == 0:
            raise ConfigError("dataset is empty")
        self.num_samples = n // num_replicas if drop_last else -(-n // num_replicas)
        if self.num_samples == 0:
            raise ConfigError(f"dataset of {n} samples is smaller than num_replicas={num_replicas}")
        self.epoch = 0
        self.consumed = 0  # samples of this rank consumed in the current epoch

    def _indices(self) -> list[int]:
        n = len(self.dataset)
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(n, generator=g).tolist()
        else:
            order = list(range(n))
        total = self.num_samples * self.num_replicas
        if total > n:
            order += order[: total - n]
        return order[:total][self.rank :: self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        if self.consumed >= self.num_samples:
            self.epoch, self.consumed = self.epoch + 1, 0
        return iter(self._indices()[self.consumed :])

    def __len__(self) -> int:
        return self.num_samples - self.consumed

    def advance(self, n: int) -> None:
        """Record that `n` more samples were consumed by the training loop."""
        self.consumed += n

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "consumed": self.consumed,
            "seed": self.seed,
            "num_replicas": self.num_replicas,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("seed") != self.seed:
            raise CheckpointError(
                f"sampler seed {state.get('seed')} in checkpoint != configured seed {self.seed}"
            )
        if state.get("num_replicas") != self.num_replicas:
            # Same global position, re-split over the new dp size.
            consumed_global = int(state["consumed"]) * int(state["num_replicas"])
            self.consumed = consumed_global // self.num_replicas
        else:
            self.consumed = int(state["consumed"])
        self.epoch = int(state["epoch"])


class StatefulDataLoader(DataLoader):
    """A DataLoader that advances its `StatefulDistributedSampler` by each batch it yields.

    Counting at the point of yield (not when the sampler is read) keeps the position exact even
    when worker processes prefetch ahead.
    """

    sampler: StatefulDistributedSampler

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        for batch in super().__iter__():
            self.sampler.advance(self.batch_size or 1)
            yield batch
        # Epoch exhausted (a dropped partial batch included): the next iterator starts a new epoch.
        self.sampler.consumed = self.sampler.num_samples

    def state_dict(self) -> dict[str, Any]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state)
