"""Global gradient-norm computation and clipping over the ranks that own disjoint gradient pieces."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from megalith.distributed import all_reduce_scalar


def global_grad_norm(
    grads: Sequence[torch.Tensor], group: dist.ProcessGroup | None = None, sharded: bool = True
) -> float:
    """‖g‖₂ over all ranks: sqrt(Σ_ranks Σ_local g²) when each rank owns a disjoint piece (`sharded`),
    or the local norm when gradients are replicated (DDP after all-reduce)."""
    per_device: dict[torch.device, torch.Tensor] = {}  # offloaded shards: host and device grads mix
    for g in grads:
        sq = g.detach().double().pow(2).sum()
        per_device[g.device] = per_device[g.device] + sq if g.device in per_device else sq
    local = sum(float(t) for t in per_device.values())  # one device sync per device
    if sharded and dist.is_initialized():
        local = all_reduce_scalar(local, group=group)  # on the backend's device (NCCL: CUDA)
    return math.sqrt(local)


def clip_grads_(grads: Sequence[torch.Tensor], max_norm: float, total_norm: float, eps: float = 1e-6) -> None:
    """Scale gradients in place by min(1, max_norm / (total_norm + eps)) (torch's clip_grad_norm_ rule)."""
    coef = max_norm / (total_norm + eps)
    if coef < 1.0 and math.isfinite(total_norm):
        for g in grads:
            g.mul_(coef)
