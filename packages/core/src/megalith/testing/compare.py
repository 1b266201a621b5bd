"""Reference-comparison helpers for equivalence tests."""

from __future__ import annotations

import torch
from torch import nn


def state_of(model: nn.Module) -> dict[str, torch.Tensor]:
    """Detached fp32 CPU copies of every parameter, by name (for comparing across processes)."""
    return {n: p.detach().float().cpu().clone() for n, p in model.named_parameters()}


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    if a.keys() != b.keys():
        raise AssertionError(f"parameter names differ: {sorted(a.keys() ^ b.keys())[:5]}")
    return max(float((a[k] - b[k]).abs().max()) for k in a) if a else 0.0


def assert_states_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float) -> None:
    if a.keys() != b.keys():
        raise AssertionError(f"parameter names differ: {sorted(a.keys() ^ b.keys())[:5]}")
    for k in a:
        diff = float((a[k] - b[k]).abs().max())
        if diff > atol:
            raise AssertionError(f"{k}: max |diff| {diff:.3e} > atol {atol:.1e}")
