"""Flat parameter buckets: the unit of ZeRO's communication and sharding.

A bucket packs a run of parameters into one contiguous buffer padded to a multiple of the dp size;
each parameter's `.data` becomes a view into it. Rank r owns the r-th of the dp equal slices of
every bucket, so reduce-scatter and all-gather work on whole buckets with no re-packing:

    flat  [p0 | p1 | p2 | pad]          # [padded_numel], padded_numel % dp == 0
    shard                  [r*S : (r+1)*S]   S = padded_numel / dp
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from megalith.optim import PieceRef


@dataclass(frozen=True)
class Slot:
    """Where one parameter lives inside its bucket's flat buffer."""

    name: str
    param: nn.Parameter
    offset: int
    numel: int


class FlatLayout:
    """Parameters packed back to back (`slots`), padded to a multiple of the dp size; rank r owns
    elements `shard_range` = [r·S, (r+1)·S) with S = padded_numel / dp. The layout of ZeRO-1/2
    buckets and of ZeRO-3 segments."""

    def __init__(self, named_params: Sequence[tuple[str, nn.Parameter]], dp_size: int, dp_rank: int) -> None:
        self.dtype = named_params[0][1].dtype
        self.slots: list[Slot] = []
        offset = 0
        for name, p in named_params:
            self.slots.append(Slot(name, p, offset, p.numel()))
            offset += p.numel()
        self.numel = offset
        self.padded_numel = -(-offset // dp_size) * dp_size
        self.shard_numel = self.padded_numel // dp_size
        self.dp_size, self.dp_rank = dp_size, dp_rank

    @property
    def shard_range(self) -> tuple[int, int]:
        lo = self.dp_rank * self.shard_numel
        return lo, lo + self.shard_numel

    def pieces(self) -> list[PieceRef]:
        """Which elements of which flattened parameters this rank's shard holds."""
        lo, hi = self.shard_range
        out = []
        for s in self.slots:
            a, b = max(lo, s.offset), min(hi, s.offset + s.numel)
            if a < b:
                out.append(PieceRef(s.name, a - s.offset, b - s.offset, a - lo))
        return out

    def __iter__(self) -> Iterator[Slot]:
        return iter(self.slots)


class FlatBucket(FlatLayout):
    """A ZeRO-1/2 bucket: the parameters' `.data` become views of one persistent flat buffer."""

    def __init__(self, named_params: Sequence[tuple[str, nn.Parameter]], dp_size: int, dp_rank: int) -> None:
        super().__init__(named_params, dp_size, dp_rank)
        self.device = named_params[0][1].device
        self.flat = torch.zeros(self.padded_numel, dtype=self.dtype, device=self.device)
        with torch.no_grad():
            for s in self.slots:
                self.flat[s.offset : s.offset + s.numel].copy_(s.param.detach().reshape(-1))
                s.param.data = self.flat[s.offset : s.offset + s.numel].view_as(s.param)
        lo, hi = self.shard_range
        self.shard = self.flat[lo:hi]
        self.ready: set[int] = set()
        # Gradient accumulation over several synchronised backwards (ZeroOptimizer): whether the
        # gradient shard already holds a reduction of this step, and (stage 1) the reduced shard
        # set aside while the flat gradient buffer collects the next backward from zero.
        self.reduced = False
        self.carry: torch.Tensor | None = None

    def flat_grads(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The bucket's local gradients packed like `flat` (zeros for params that got none and for the
        padding), into `out` if given: one write per element."""
        if out is None:
            out = torch.empty(self.padded_numel, dtype=self.dtype, device=self.device)
        for s in self.slots:
            piece = out[s.offset : s.offset + s.numel]
            if s.param.grad is None:
                piece.zero_()
            else:
                piece.copy_(s.param.grad.reshape(-1))
        out[self.numel :].zero_()
        return out


def make_buckets(
    named_params: Sequence[tuple[str, nn.Parameter]], bucket_numel: int, dp_size: int, dp_rank: int
) -> list[FlatBucket]:
    """Split parameters (in the given order) into buckets of at most `bucket_numel` elements
    (a single larger parameter gets a bucket of its own). All parameters of a bucket share a dtype."""
    buckets: list[FlatBucket] = []
    run: list[tuple[str, nn.Parameter]] = []
    size = 0
    for name, p in named_params:
        if run and (size + p.numel() > bucket_numel or p.dtype != run[0][1].dtype):
            buckets.append(FlatBucket(run, dp_size, dp_rank))
            run, size = [], 0
        run.append((name, p))
        size += p.numel()
    if run:
        buckets.append(FlatBucket(run, dp_size, dp_rank))
    return buckets
