"""Global gradient-norm computation and clipping over the ranks that own disjoint gradient pieces."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist


def global_grad_norm(
    grads: Sequence[torch.Tensor], group: dist.ProcessGroup | None = None, sharded: bool = True
) -> float:
    """‖g‖₂ over all ranks: sqrt(Σ_ranks Σ_local g²) when each rank owns a disjoint piece (`sharded`),
    or the local norm when gradients are replicated (DDP after all-reduce)."""
    device = grads[0].device if grads else torch.device("cpu")
    local = torch.zeros((), dtype=torch.float64, device=device)
    for g in grads:
        local += g.detach().double().pow(2).sum()
    if sharded and dist.is_initialized():
        dist.all_reduce(local, group=group)
    return math.sqrt(float(local))


def clip_grads_(grads: Sequence[torch.Tensor], max_norm: float, total_norm: float, eps: float = 1e-6) -> None:
    """Scale gradients in place by min(1, max_norm / (total_norm + eps)) (torch's clip_grad_norm_ rule)."""
    coef = max_norm / (total_norm + eps)
    if coef < 1.0 and math.isfinite(total_norm):
        for g in grads:
            g.mul_(coef)
