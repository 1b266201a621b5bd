"""Collective helpers that fail with a clear cause instead of hanging."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from megalith.common.errors import DistributedError


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
