"""Count the communication volume of collectives: `with count_comm() as c: ...; c.bytes_sent`.

The collective helpers (`reduce_scatter_flat`, `all_gather_flat`, `all_reduce_flat`) report every
call to the active counters. Volumes are the *logical* bytes one rank sends under the ring
algorithms (Patarasuk & Yuan 2009), whatever the backend does internally — S bytes, N ranks:

    all-reduce       2 (N-1)/N · S        (reduce-scatter + all-gather)
    reduce-scatter     (N-1)/N · S        (S = the full input)
    all-gather         (N-1)/N · S        (S = the full output)

so DDP's step is 2(N-1)/N·Ψ·b and ZeRO-3's 3(N-1)/N·Ψ·b (ZeRO paper, §7).
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

import torch

FACTORS = {"all_reduce": 2.0, "reduce_scatter": 1.0, "all_gather": 1.0}


class CommCounter:
    def __init__(self) -> None:
        self.by_op: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def record(self, op: str, tensor: torch.Tensor, world: int) -> None:
        """Add one collective `op` over `tensor` (the full buffer) among `world` ranks."""
        if op not in FACTORS:
            raise ValueError(f"unknown collective {op!r}; expected one of {sorted(FACTORS)}")
        size = tensor.numel() * tensor.element_size()
        self.by_op[op] += FACTORS[op] * (world - 1) / world * size
        self.calls[op] += 1

    @property
    def bytes_sent(self) -> float:
        return sum(self.by_op.values())


_lock = threading.Lock()
_active: list[CommCounter] = []  # counters are process-wide: autograd may run hooks on other threads


@contextmanager
def count_comm() -> Iterator[CommCounter]:
    """Count the collectives issued through megalith's helpers inside the block (this process)."""
    counter = CommCounter()
    with _lock:
        _active.append(counter)
    try:
        yield counter
    finally:
        with _lock:
            _active.remove(counter)


def report(op: str, tensor: torch.Tensor, world: int) -> None:
    """Called by the collective helpers."""
    if _active:
        with _lock:
            for counter in _active:
                counter.record(op, tensor, world)
