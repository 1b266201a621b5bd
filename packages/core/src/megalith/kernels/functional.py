"""Differentiable kernel functions (autograd.Functions over the `megalith::*` custom ops).

Shapes: RMSNorm x [..., N], w [N]; rotary q [B, H, S, D], k [B, KV, S, D], cos/sin [B|1, S, D]
(HF's `rotary_emb` output, `unsqueeze_dim=1`); SwiGLU gate/up [..., I]; fused linear CE hidden
[T, H], weight [V, H], labels [T].
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from megalith.common.errors import ConfigError
from megalith.kernels import custom_ops as ops

# Device types with an autocast mode, found once here: Dynamo cannot trace
# `torch.amp.is_autocast_available` in torch 2.11 (one graph break per call inside a compiled step),
# while `is_autocast_enabled` / `get_autocast_dtype` are constant-folded.
_AUTOCAST_DEVICES = frozenset(
    d
    for d in ("cpu", "cuda", "xpu", "mps", "hpu", "mtia", "maia", "xla", "ipu", "meta")
    if torch.amp.is_autocast_available(d)
)


def _autocast_dtype(t: Tensor) -> torch.dtype | None:
    """The dtype `torch.autocast` runs a matmul of `t` in (None outside an autocast region)."""
    device = t.device.type
    if device in _AUTOCAST_DEVICES and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return None


def _rows(x: Tensor, n: int) -> Tensor:
    """x as a [M, n] matrix whose rows are unit-stride (a view when possible)."""
    x2 = x.reshape(-1, n)
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor, eps: float) -> Tensor:
        x2 = _rows(x, x.shape[-1])
        y, rstd = ops.rms_norm_fwd(x2, w, eps)
        ctx.save_for_backward(x2, w, rstd)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor | None, ...]:
        x2, w, rstd = ctx.saved_tensors
        dx, dw = ops.rms_norm_bwd(_rows(dy, x2.shape[1]), x2, w, rstd)
        return dx.view(dy.shape), dw, None


def rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6) -> Tensor:
    """y = x / √(mean(x², last dim) + eps) · weight (Zhang & Sennrich 2019), fp32 statistics."""
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ConfigError(f"rms_norm: weight shape {tuple(weight.shape)} does not match x {tuple(x.shape)}")
    # the Triton kernels index w with unit stride; contiguous() is the same tensor when it already is
    return _RMSNorm.apply(x, weight.contiguous(), eps)


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        ctx.save_for_backward(cos, sin)
        return ops.rope(q, cos, sin, False), ops.rope(k, cos, sin, False)

    @staticmethod
    def backward(ctx: Any, dq: Tensor, dk: Tensor) -> tuple[Tensor | None, ...]:
        cos, sin = ctx.saved_tensors
        return ops.rope(dq, cos, sin, True), ops.rope(dk, cos, sin, True), None, None


def apply_rotary(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """Rotary embedding (Su et al. 2021), HF Llama convention: x·cos + rotate_half(x)·sin with
    rotate_half(x) = [−x₂, x₁]; q [B, H, S, D], k [B, KV, S, D], cos/sin [B|1, S, D]."""
    for name, t in (("q", q), ("k", k)):
        if t.dim() != 4 or t.shape[-1] != cos.shape[-1] or t.shape[-1] % 2 or t.shape[2] != cos.shape[-2]:
            raise ConfigError(
                f"apply_rotary: {name} {tuple(t.shape)} must be [B, H, S, D] with even D matching "
                f"cos {tuple(cos.shape)} [B, S, D]"
            )
    if cos.shape != sin.shape or cos.dim() != 3:
        raise ConfigError(
            f"apply_rotary: cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must be [B, S, D]"
        )
    return _Rotary.apply(q, k, cos, sin)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, gate: Tensor, up: Tensor) -> Tensor:
        n = gate.shape[-1]
        g2, u2 = _rows(gate, n), _rows(up, n)
        ctx.save_for_backward(g2, u2)
        return ops.swiglu_fwd(g2, u2).view(gate.shape)

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor, Tensor]:
        g2, u2 = ctx.saved_tensors
        n = g2.shape[1]
        dgu = ops.swiglu_bwd(_rows(dy, n), g2, u2)
        return dgu[:, :n].view(dy.shape), dgu[:, n:].view(dy.shape)


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """silu(gate)·up (Shazeer 2020); the backward recomputes σ(gate) instead of saving it."""
    if gate.shape != up.shape:
        raise ConfigError(f"swiglu: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
    return _SwiGLU.apply(gate, up)


class _SwiGLUMLP(torch.autograd.Function):
    """down(silu(x Wgᵀ)·(x Wuᵀ)) with the hidden h = silu(g)·u not saved: the backward's SwiGLU
    kernel rebuilds it from g, u while it computes their gradients. Per token it keeps x [H] and
    g, u [I] (2I + H values) where the module keeps x, g, u and h (3I + H). Gate and up are two
    matmuls into contiguous outputs (writing both into halves of one [M, 2I] buffer made each a
    strided-output GEMM, ~4 % slower on an H200); their gradients come out side by side as
    [dg | du] so the weight gradient is one matmul."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor) -> Tensor:
        x2 = _rows(x, x.shape[-1])
        g, u = x2 @ w_gate.t(), x2 @ w_up.t()
        h = ops.swiglu_fwd(g, u)
        ctx.save_for_backward(x2, g, u, w_gate, w_up, w_down)
        return (h @ w_down.t()).view(*x.shape[:-1], w_down.shape[0])

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor, ...]:
        x2, g, u, w_gate, w_up, w_down = ctx.saved_tensors
        n = w_gate.shape[0]
        dy2 = _rows(dy, dy.shape[-1])
        dgu, h = ops.swiglu_bwd_h(dy2 @ w_down, g, u)  # [M, 2I] = [dg | du], h [M, I]
        dw_down = dy2.t() @ h
        del h
        dx = torch.addmm(dgu[:, :n] @ w_gate, dgu[:, n:], w_up)
        dw_gu = dgu.t() @ x2
        return dx.view(*dy.shape[:-1], x2.shape[1]), dw_gu[:n], dw_gu[n:], dw_down


def swiglu_mlp(x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor) -> Tensor:
    """The Llama MLP without biases: x [..., H], w_gate/w_up [I, H], w_down [H, I] → [..., H]."""
    h = x.shape[-1]
    if w_gate.shape != w_up.shape or w_gate.shape[1] != h or w_down.shape != (h, w_gate.shape[0]):
        raise ConfigError(
            f"swiglu_mlp: x {tuple(x.shape)}, gate {tuple(w_gate.shape)}, up {tuple(w_up.shape)}, "
            f"down {tuple(w_down.shape)} do not fit [..., H], [I, H], [I, H], [H, I]"
        )
    cast = _autocast_dtype(x)
    if cast is None:
        return _SwiGLUMLP.apply(x, w_gate, w_up, w_down)
    # Under torch.autocast HF's three nn.Linear run in the autocast dtype, x and the weights cast per
    # call (the casts' backward returns the gradients in the parameters' dtype). The Function gets
    # the same operands, all of one dtype, so its forward and backward matmuls never mix dtypes.
    with torch.autocast(x.device.type, enabled=False):
        return _SwiGLUMLP.apply(*(t.to(cast) for t in (x, w_gate, w_up, w_down)))


class _FusedLinearCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, h: Tensor, w: Tensor, labels: Tensor, ignore_index: int, mean: bool) -> Tensor:
        need = bool(ctx.needs_input_grad[0] or ctx.needs_input_grad[1])
        loss, dh, dw = ops.fused_linear_ce(h, w, labels, ignore_index, mean, need)
        ctx.save_for_backward(dh, dw)
        return loss

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        dh, dw = ctx.saved_tensors
        dh = dh * grad.to(dh.dtype) if ctx.needs_input_grad[0] else None
        dw = dw * grad.to(dw.dtype) if ctx.needs_input_grad[1] else None
        return dh, dw, None, None, None


def fused_linear_cross_entropy(
    hidden: Tensor, weight: Tensor, labels: Tensor, ignore_index: int = -100, reduction: str = "mean"
) -> Tensor:
    """CE(hidden Wᵀ, labels) without materialising the [T, V] logits: the forward computes the loss
    and the gradients of hidden and W chunk by chunk of rows (stored for backward, as Liger-Kernel
    does); `mean` averages over non-ignored tokens, `sum` sums. bf16 inputs, fp32 accumulation.

    Labels must lie in [0, V) or equal `ignore_index` (see `custom_ops.check_labels`). Under
    `torch.autocast` hidden and W are cast to the autocast dtype first, as HF's LM head
    (`nn.Linear`) is; the loss is fp32 either way (HF upcasts the logits for its loss)."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ConfigError(
            f"fused_linear_cross_entropy: hidden {tuple(hidden.shape)} must be [T, H] and weight "
            f"{tuple(weight.shape)} [V, H]"
        )
    if labels.shape != hidden.shape[:1]:
        raise ConfigError(
            f"fused_linear_cross_entropy: labels {tuple(labels.shape)} must be [{hidden.shape[0]}]"
        )
    cast = _autocast_dtype(hidden)
    if cast is not None:
        hidden, weight = hidden.to(cast), weight.to(cast)
    if hidden.dtype != weight.dtype:
        raise ConfigError(
            f"fused_linear_cross_entropy: hidden {hidden.dtype} and weight {weight.dtype} differ"
        )
    if reduction not in ("mean", "sum"):
        raise ConfigError(f"fused_linear_cross_entropy: reduction must be 'mean' or 'sum', got {reduction!r}")
    labels = labels.contiguous()  # the Triton kernel reads one label per row with unit stride
    if cast is None:
        return _FusedLinearCE.apply(hidden, weight, labels, ignore_index, reduction == "mean")
    with torch.autocast(hidden.device.type, enabled=False):  # the chunks' matmuls keep `cast`
        return _FusedLinearCE.apply(hidden, weight, labels, ignore_index, reduction == "mean")
