"""The kernels as torch custom ops (``megalith::*``), so `torch.compile` treats each launch as one
opaque node instead of breaking the graph. Each op's body dispatches per call (Triton or the torch
fallback, see `registry.pick_backend`); fake implementations give shapes for tracing. Eager calls
run the body directly: the op dispatcher's per-call host cost is that of a small kernel, and in a
training step the host falling behind the GPU leaves it idle."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from megalith.common.errors import ConfigError
from megalith.kernels import ops_torch, ops_triton  # noqa: F401  (registers both backends)
from megalith.kernels.registry import get_kernel


class _op:  # a decorator, like torch.library.custom_op
    """``megalith::<name>`` for `torch.compile`; the plain function when not compiling."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.op = torch.library.custom_op(f"megalith::{fn.__name__}", mutates_args=())(fn)
        self.register_fake = self.op.register_fake

    def __call__(self, *args: Any) -> Any:
        return self.op(*args) if torch.compiler.is_compiling() else self.fn(*args)


_rms_fwd = get_kernel("rms_norm_fwd")
_rms_bwd = get_kernel("rms_norm_bwd")
_rope = get_kernel("rope")
_swiglu_fwd = get_kernel("swiglu_fwd")
_swiglu_bwd = get_kernel("swiglu_bwd")
_swiglu_bwd_h = get_kernel("swiglu_bwd_h")
_ce_rows = get_kernel("ce_rows")


@_op
def rms_norm_fwd(x: Tensor, w: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    return _rms_fwd(x, w, eps)


@rms_norm_fwd.register_fake
def _(x: Tensor, w: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    return torch.empty_like(x), x.new_empty(x.shape[0], dtype=torch.float32)


@_op
def rms_norm_bwd(dy: Tensor, x: Tensor, w: Tensor, rstd: Tensor) -> tuple[Tensor, Tensor]:
    return _rms_bwd(dy, x, w, rstd)


@rms_norm_bwd.register_fake
def _(dy: Tensor, x: Tensor, w: Tensor, rstd: Tensor) -> tuple[Tensor, Tensor]:
    return torch.empty_like(x), torch.empty_like(w)


@_op
def rope(x: Tensor, cos: Tensor, sin: Tensor, backward: bool) -> Tensor:
    return _rope(x, cos, sin, backward)


@rope.register_fake
def _(x: Tensor, cos: Tensor, sin: Tensor, backward: bool) -> Tensor:
    return torch.empty_like(x)


@_op
def swiglu_fwd(g: Tensor, u: Tensor) -> Tensor:
    return _swiglu_fwd(g, u)


@swiglu_fwd.register_fake
def _(g: Tensor, u: Tensor) -> Tensor:
    return g.new_empty(g.shape)


@_op
def swiglu_bwd(dy: Tensor, g: Tensor, u: Tensor) -> Tensor:
    return _swiglu_bwd(dy, g, u)


@swiglu_bwd.register_fake
def _(dy: Tensor, g: Tensor, u: Tensor) -> Tensor:
    return g.new_empty(g.shape[0], 2 * g.shape[1])


@_op
def swiglu_bwd_h(dy: Tensor, g: Tensor, u: Tensor) -> tuple[Tensor, Tensor]:
    return _swiglu_bwd_h(dy, g, u)


@swiglu_bwd_h.register_fake
def _(dy: Tensor, g: Tensor, u: Tensor) -> tuple[Tensor, Tensor]:
    return g.new_empty(g.shape[0], 2 * g.shape[1]), g.new_empty(g.shape)


def chunk_rows(tokens: int, vocab: int, hidden: int) -> int:
    """Rows per logits chunk: a power of two near T / ⌈V / 4H⌉, so one [rows, V] chunk holds about
    as many elements as four [T, H] activations (TinyLlama at 16k tokens: 4096 rows, 4 chunks).
    Fewer chunks mean fewer passes over the fp32 dW accumulator: on an H200, 4096 rows were 0.4–0.5 %
    faster per training step than 2048 at the same peak memory (benchmarks/gpu_train_ab.py)."""
    rows = max(1, tokens // max(1, -(-vocab // (4 * hidden))))
    return max(1, min(tokens, 1 << (rows.bit_length() - 1)))


def check_labels(labels: Tensor, valid: Tensor, vocab: int, ignore_index: int) -> None:
    """Every label is in [0, vocab) or equals `ignore_index` (`valid` = labels != ignore_index);
    the CE kernels would otherwise read outside the row's logits (the torch fallback raises an
    index error, the Triton kernel reads whatever lies there).

    On CPU: a host check, ConfigError naming the label (CPU tensors cost no sync). On an
    accelerator: `torch._assert_async`, a device-side assert queued behind the loss, the way torch's
    own CUDA cross-entropy fails on such a label: a host check (`.any()` read back) would sync every
    step and drain the launch queue the step's host keeps ahead of the GPU, for a few small kernels
    of cost here instead."""
    bad = valid & ((labels < 0) | (labels >= vocab))
    if labels.device.type != "cpu":
        torch._assert_async(
            ~bad.any(),
            f"fused_linear_cross_entropy: a label is outside [0, {vocab}) and is not ignore_index={ignore_index}",
        )
    elif bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise ConfigError(
            f"fused_linear_cross_entropy: label {int(labels[i])} at position {i} is outside "
            f"[0, {vocab}) and is not ignore_index={ignore_index}"
        )


@_op
def fused_linear_ce(
    h: Tensor, w: Tensor, labels: Tensor, ignore_index: int, mean: bool, with_grad: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """loss = Σ_t CE(h_t Wᵀ, y_t)·scale (scale 1/#non-ignored if `mean`), computed chunk by chunk
    of rows; the chunk's logits [c, V] are overwritten with dloss/dlogits and turned into
    dh [T, H] and dW [V, H] (accumulated in fp32) right away, so [T, V] never exists."""
    t, _ = h.shape
    valid = labels != ignore_index
    check_labels(labels, valid, w.shape[0], ignore_index)
    count = valid.sum()
    scale = (1.0 / count.clamp(min=1).float()) if mean else torch.ones((), device=h.device)
    scale = scale.reshape(1).to(torch.float32)
    dh = torch.empty_like(h) if with_grad else h.new_empty(0)
    dw = torch.zeros(w.shape, dtype=torch.float32, device=w.device) if with_grad else w.new_empty(0)
    loss = torch.zeros((), dtype=torch.float32, device=h.device)
    step = chunk_rows(t, w.shape[0], w.shape[1])
    for s in range(0, t, step):
        hc = h[s : s + step]
        logits = hc @ w.t()  # [c, V]
        loss += _ce_rows(logits, labels[s : s + step], scale, ignore_index).sum()
        if with_grad:
            torch.mm(logits, w, out=dh[s : s + step])
            _accumulate_mm(dw, logits.t(), hc)
    return loss, dh, dw.to(w.dtype) if with_grad else dw


_HAS_ADDMM_OUT_DTYPE = hasattr(torch.ops.aten.addmm, "dtype_out")  # torch >= 2.8 (CUDA kernels)


def _accumulate_mm(acc: Tensor, a: Tensor, b: Tensor) -> None:
    """acc (fp32) += a @ b: one matmul with fp32 output and beta = 1 on CUDA (bf16/fp16 inputs),
    else the product is formed in the inputs' dtype and added."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    elif acc.is_cuda and _HAS_ADDMM_OUT_DTYPE:
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    else:
        acc += a @ b


@fused_linear_ce.register_fake
def _(
    h: Tensor, w: Tensor, labels: Tensor, ignore_index: int, mean: bool, with_grad: bool
) -> tuple[Tensor, Tensor, Tensor]:
    loss = h.new_empty((), dtype=torch.float32)
    if not with_grad:
        return loss, h.new_empty(0), w.new_empty(0)
    return loss, torch.empty_like(h), torch.empty_like(w)
