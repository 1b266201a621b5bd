"""Collective helpers that fail with a clear cause instead of hanging."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from megalith.common.errors import DistributedError
from megalith.distributed.comm_counter import report


def world_size(group: dist.ProcessGroup | None = None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def rank(group: dist.ProcessGroup | None = None) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


def barrier(timeout_s: float = 300.0, group: dist.ProcessGroup | None = None) -> None:
    """Barrier that names the ranks that did not arrive (monitored barrier on gloo)."""
    if not dist.is_initialized():
        return
    try:
        if dist.get_backend(group) == "gloo":
            dist.monitored_barrier(group=group, timeout=timedelta(seconds=timeout_s), wait_all_ranks=True)
        else:
            dist.barrier(group=group)
    except RuntimeError as exc:
        raise DistributedError(f"barrier failed after up to {timeout_s:.0f}s: {exc}") from exc


def comm_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where a small tensor for a collective on `group` must live: the current CUDA device for
    NCCL, the CPU otherwise (gloo)."""
    if dist.is_initialized() and "nccl" in str(dist.get_backend(group)):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_scalar(
    value: float, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM, group: dist.ProcessGroup | None = None
) -> float:
    """All-reduce one Python number (float64 on CPU for gloo, on the current device for NCCL)."""
    if not dist.is_initialized():
        return value
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op, group=group)
    return float(t.item())


def broadcast_object(obj: object, src: int = 0, group: dist.ProcessGroup | None = None) -> object:
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


class Handle:
    """Completion handle for a composite collective; `wait()` finishes it (idempotent)."""

    def __init__(self, works: list[Any], then: Callable[[], object] | None = None) -> None:
        self._works, self._then = works, then

    def wait(self) -> None:
        for w in self._works:
            w.wait()
        self._works = []
        if self._then is not None:
            self._then()
            self._then = None


def _global(group: dist.ProcessGroup | None, r: int) -> int:
    return r if group is None else dist.get_global_rank(group, r)


def reduce_scatter_flat(
    out: torch.Tensor, flat: torch.Tensor, group: dist.ProcessGroup | None = None, async_op: bool = False
) -> Handle:
    """`out` ← Σ over ranks of chunk r of `flat` (r = this rank; `flat` splits into equal chunks).

    On gloo this is one `reduce` to each chunk's owner — measured about 2x faster than gloo's
    `reduce_scatter_tensor` on CPU — and `flat` is used as scratch (its contents are undefined after).
    Elsewhere it is `reduce_scatter_tensor`.
    """
    n = dist.get_world_size(group)
    report("reduce_scatter", flat, n)
    if dist.get_backend(group) != "gloo":
        work = dist.reduce_scatter_tensor(out, flat, group=group, async_op=async_op)
        handle = Handle([work] if async_op else [])
    else:
        chunks = flat.chunk(n)
        works = [dist.reduce(chunks[r], dst=_global(group, r), group=group, async_op=True) for r in range(n)]
        me = dist.get_rank(group)
        handle = Handle(works, lambda: out.copy_(chunks[me]))
    if not async_op:
        handle.wait()
    return handle


def all_gather_flat(
    flat: torch.Tensor, group: dist.ProcessGroup | None = None, async_op: bool = False
) -> Handle:
    """Every rank's chunk r of `flat` ← rank r's chunk r (chunk of this rank already filled in place).

    On gloo this is one `broadcast` from each owner — measured 3x faster than gloo's all-gather —
    elsewhere `all_gather_into_tensor` (from a copy of the own chunk, so input and output never alias).
    """
    n = dist.get_world_size(group)
    report("all_gather", flat, n)
    chunks = flat.chunk(n)
    if dist.get_backend(group) != "gloo":
        me = dist.get_rank(group)
        work = dist.all_gather_into_tensor(flat, chunks[me].clone(), group=group, async_op=async_op)
        handle = Handle([work] if async_op else [])
    else:
        works = [
            dist.broadcast(chunks[r], src=_global(group, r), group=group, async_op=True) for r in range(n)
        ]
        handle = Handle(works)
    if not async_op:
        handle.wait()
    return handle


def all_reduce_flat(
    flat: torch.Tensor, group: dist.ProcessGroup | None = None, async_op: bool = False
) -> Handle:
    """`flat` ← Σ over ranks of `flat` (reported to the communication counters)."""
    report("all_reduce", flat, dist.get_world_size(group))
    work = dist.all_reduce(flat, group=group, async_op=async_op)
    return Handle([work] if async_op else [])
