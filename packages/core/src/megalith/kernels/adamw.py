"""`FusedAdamW`: torch.optim.AdamW's update (decoupled weight decay, bias correction) as one fused
kernel launch per tensor: each element's p, g, m, v are read once and p, m, v written once
(16 B/element read + 12 B written in fp32), against ~5 passes for an unfused implementation.
The host work around the launches is kept per group (one step-counter update, the backend chosen
once per device and dtypes): for a 1B model the launches' host cost is close to their GPU time.
(A single multi-tensor launch over a table of addresses cut the host cost 3x but lost more GPU
time than it saved on an H200: 73.7k vs 76.8k tokens/s on the TinyLlama benchmark.)"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from megalith.common.errors import ConfigError
from megalith.kernels import ops_torch, ops_triton  # noqa: F401  (registers both backends)
from megalith.kernels.registry import get_kernel, pick_backend

_torch_adamw = get_kernel("adamw", "torch")
_triton_adamw = get_kernel("adamw", "triton")


def adamw_step(
    p: torch.Tensor,
    g: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    hyper: tuple[float, float, float, float, float],
    step: int,
) -> None:
    """One in-place AdamW update of tensor p (hyper = lr, beta1, beta2, eps, weight_decay; step ≥ 1)."""
    dense = all(t.is_contiguous() for t in (p, g, m, v))
    if dense and pick_backend(p, g, m, v) == "triton":
        _triton_adamw(p, g, m, v, hyper, step)
    else:
        _torch_adamw(p, g, m, v, hyper, step)


class FusedAdamW(torch.optim.Optimizer):
    """Drop-in for `torch.optim.AdamW` (same state keys: step, exp_avg, exp_avg_sq; amsgrad,
    maximize and sparse gradients are not supported)."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
    ) -> None:
        if lr < 0 or eps < 0 or weight_decay < 0:
            raise ConfigError(f"FusedAdamW: lr={lr}, eps={eps}, weight_decay={weight_decay} must be >= 0")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ConfigError(f"FusedAdamW: betas {betas} must lie in [0, 1)")
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            hyper = (float(group["lr"]), beta1, beta2, group["eps"], group["weight_decay"])
            todo: list[tuple[torch.Tensor, ...]] = []
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise ConfigError("FusedAdamW does not support sparse gradients")
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                todo.append((p, p.grad, state["exp_avg"], state["exp_avg_sq"], state["step"]))
            if todo:
                _update(todo, hyper)
        return loss


def _update(todo: list[tuple[torch.Tensor, ...]], hyper: tuple[float, float, float, float, float]) -> None:
    """Step every (p, g, m, v, step) of one group."""
    torch._foreach_add_([t[4] for t in todo], 1.0)
    backends: dict[tuple[Any, ...], str] = {}
    for p, g, m, v, step_t in todo:
        kind = (p.device, p.dtype, g.dtype, m.dtype, v.dtype)
        if kind not in backends:
            backends[kind] = pick_backend(p, g, m, v)
        step = int(step_t.item())
        if backends[kind] == "triton" and all(t.is_contiguous() for t in (p, g, m, v)):
            _triton_adamw(p, g, m, v, hyper, step)
        else:
            _torch_adamw(p, g, m, v, hyper, step)
