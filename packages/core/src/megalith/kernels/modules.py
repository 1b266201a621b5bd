"""Kernel-backed drop-in modules."""

from __future__ import annotations

import torch
from torch import nn

from megalith.kernels.functional import rms_norm


class KernelRMSNorm(nn.Module):
    """RMSNorm over the last dim with the fused kernel; holds (shares) an existing weight so a
    swapped-in instance keeps the parameter object, its name and its optimizer state."""

    def __init__(self, weight: nn.Parameter, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = weight
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return rms_norm(hidden_states, self.weight, self.variance_epsilon)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"
