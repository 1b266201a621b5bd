"""Torch fallbacks of every kernel: plain fp32-accumulating torch code with the Triton kernels'
signatures. They are the CPU path and the reference the Triton kernels are tested against."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from megalith.kernels.registry import register_kernel


@register_kernel("rms_norm_fwd", "torch")
def rms_norm_fwd(x: torch.Tensor, w: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, N] → (y = x·rstd·w [M, N], rstd = 1/√(mean(x²)+eps) [M] fp32)."""
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1) + eps)
    return (xf * rstd[:, None] * w.float()).to(x.dtype), rstd


@register_kernel("rms_norm_bwd", "torch")
def rms_norm_bwd(
    dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """dx = rstd·(w⊙dy − x̂·mean(x̂⊙w⊙dy)) [M, N]; dw = Σ_rows dy⊙x̂ [N]."""
    xh = x.float() * rstd[:, None]
    wdy = dy.float() * w.float()
    c = (xh * wdy).mean(-1, keepdim=True)
    dx = (wdy - xh * c) * rstd[:, None]
    return dx.to(x.dtype), (dy.float() * xh).sum(0).to(w.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@register_kernel("rope", "torch")
def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool) -> torch.Tensor:
    """x [B, H, S, D], cos/sin [B|1, S, D]: x·cos + rotate_half(x)·sin; backward applies the
    transpose x·cos + rotate_halfᵀ(x·sin) with rotate_halfᵀ(y) = [y₂, −y₁]."""
    c, s = cos.unsqueeze(1).float(), sin.unsqueeze(1).float()
    xf = x.float()
    if backward:
        y = xf * s
        half = x.shape[-1] // 2
        out = xf * c + torch.cat((y[..., half:], -y[..., :half]), dim=-1)
    else:
        out = xf * c + rotate_half(xf) * s
    return out.to(x.dtype)


@register_kernel("swiglu_fwd", "torch")
def swiglu_fwd(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """silu(g)·u for 2-D g, u [M, N]."""
    return (F.silu(g.float()) * u.float()).to(g.dtype)


@register_kernel("swiglu_bwd", "torch")
def swiglu_bwd(dy: torch.Tensor, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """[dg | du] as one [M, 2N] tensor: du = dy·silu(g), dg = dy·u·σ(g)(1 + g(1 − σ(g)))."""
    gf, uf, dyf = g.float(), u.float(), dy.float()
    sig = torch.sigmoid(gf)
    dg = dyf * uf * sig * (1 + gf * (1 - sig))
    return torch.cat((dg, dyf * gf * sig), dim=-1).to(g.dtype)


@register_kernel("swiglu_bwd_h", "torch")
def swiglu_bwd_h(dy: torch.Tensor, g: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(swiglu_bwd, swiglu_fwd) of the same inputs: the backward plus the forward's output h."""
    return swiglu_bwd(dy, g, u), swiglu_fwd(g, u)


@register_kernel("ce_rows", "torch")
def ce_rows(
    logits: torch.Tensor, labels: torch.Tensor, scale: torch.Tensor, ignore_index: int
) -> torch.Tensor:
    """In place: logits [C, V] ← (softmax − onehot)·scale (0 on ignored rows); returns the per-row
    loss (logsumexp − z[label])·scale [C] fp32."""
    z = logits.float()
    valid = labels != ignore_index
    safe = torch.where(valid, labels, torch.zeros_like(labels))
    lse = torch.logsumexp(z, dim=-1)
    coef = torch.where(valid, scale.float(), torch.zeros((), device=z.device))
    loss = (lse - z.gather(1, safe[:, None])[:, 0]) * coef
    grad = torch.exp(z - lse[:, None])
    grad.scatter_add_(1, safe[:, None], -torch.ones_like(lse)[:, None])
    logits.copy_(grad * coef[:, None])
    return loss


@register_kernel("adamw", "torch")
def adamw_(
    p: torch.Tensor,
    g: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    hyper: tuple[float, float, float, float, float],
    step: int,
) -> None:
    """In-place AdamW on one tensor; hyper = (lr, beta1, beta2, eps, weight_decay)."""
    lr, beta1, beta2, eps, wd = hyper
    p.mul_(1 - lr * wd)
    m.lerp_(g.to(m.dtype), 1 - beta1)
    v.mul_(beta2).addcmul_(g.to(v.dtype), g.to(v.dtype), value=1 - beta2)
    denom = (v.sqrt() / math.sqrt(1 - beta2**step)).add_(eps)
    p.addcdiv_(m, denom, value=-lr / (1 - beta1**step))


@register_kernel("adamw_captured", "torch")
def adamw_captured_(
    p: torch.Tensor,
    g: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    hyper: tuple[float, float, float, float, float],
    step: torch.Tensor,
    lr: torch.Tensor,
) -> None:
    """`adamw_` with the step count and lr as tensors (no host value that changes per step)."""
    _, beta1, beta2, eps, wd = hyper
    lr = lr.to(p.dtype)
    p.mul_(1 - lr * wd)
    m.lerp_(g.to(m.dtype), 1 - beta1)
    v.mul_(beta2).addcmul_(g.to(v.dtype), g.to(v.dtype), value=1 - beta2)
    bc1 = 1 - torch.pow(beta1, step)
    bc2 = 1 - torch.pow(beta2, step)
    denom = (v.sqrt() / bc2.sqrt().to(v.dtype)).add_(eps)
    p.sub_(m / denom * (lr / bc1.to(p.dtype)))
