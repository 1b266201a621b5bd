"""Optimizer wrappers, loss scaling and global-norm clipping (layer 4)."""

from megalith.optim.clip import clip_grads_, global_grad_norm
from megalith.optim.fused import prefer_fused
from megalith.optim.grad_scaler import DynamicLossScaler
from megalith.optim.wrapper import BoostedOptimizer, PieceRef, ReplicatedOptimizer

__all__ = [
    "BoostedOptimizer",
    "DynamicLossScaler",
    "PieceRef",
    "ReplicatedOptimizer",
    "clip_grads_",
    "global_grad_norm",
    "prefer_fused",
]
