"""The decode step's MLP activation as one Triton kernel: the post-attention norm's ``1 / rms(x)``
and SwiGLU, ``silu(gate / rms(x)) * up / rms(x)``.

``gate_up = x W_gu'^T`` is the projection of the un-normalised residual stream ``x`` by the
norm-folded weight (:mod:`.fast_weights`), so this kernel replaces both the norm kernel and the
activation kernel of the unfused layer. Grid ``(b, I / BLOCK)``: each program computes its row's
``1 / rms(x)`` (``hidden`` values) and activates ``BLOCK`` of the ``I`` outputs.

:func:`norm_silu_mul` is the entry point; :func:`.fast_ops.norm_silu_mul` is the same in torch (the
engine's CPU path and the tests' reference). Kernels are built lazily (``TRITON_INTERPRET=1`` then
runs them on the CPU, which is how the tests check them).
"""

# ruff: noqa: PLR0913  (Triton kernels take their pointers, strides and sizes as arguments)
from __future__ import annotations

from functools import cache
from typing import Any

import torch

BLOCK = 512  # outputs per program


def make_kernel() -> Any:
    """A fresh Triton kernel (reads ``TRITON_INTERPRET`` now)."""
    import triton
    import triton.language as tl

    # arguments stay unannotated: @triton.jit reads annotations (tl.constexpr) to specialise a kernel
    @triton.jit
    def norm_silu(gu_ptr, x_ptr, out_ptr, s_gu, s_x, s_out, inter, hidden, eps,  # type: ignore[no-untyped-def]
                  BLOCK: tl.constexpr, HIDDEN: tl.constexpr):  # fmt: skip
        r = tl.program_id(0).to(tl.int64)
        i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        live = i < inter
        gate = tl.load(gu_ptr + r * s_gu + i, mask=live, other=0.0).to(tl.float32)
        up = tl.load(gu_ptr + r * s_gu + inter + i, mask=live, other=0.0).to(tl.float32)
        e = tl.arange(0, HIDDEN)
        xr = tl.load(x_ptr + r * s_x + e, mask=e < hidden, other=0.0).to(tl.float32)
        scale = 1.0 / tl.sqrt(tl.sum(xr * xr, axis=0) / hidden + eps)
        gate, up = gate * scale, up * scale
        out = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(out_ptr + r * s_out + i, out.to(out_ptr.dtype.element_ty), mask=live)

    return norm_silu


@cache
def _kernel() -> Any:
    return make_kernel()


def norm_silu_mul(gate_up: torch.Tensor, x: torch.Tensor, eps: float, kernel: Any = None) -> torch.Tensor:
    """``gate_up [b, 2I]``, ``x [b, hidden]`` (rows unit-stride) -> ``[b, I]``."""
    b, width = gate_up.shape
    inter, hidden = width // 2, x.shape[1]
    out = gate_up.new_empty(b, inter)
    (kernel or _kernel())[(b, -(-inter // BLOCK))](
        gate_up, x, out, gate_up.stride(0), x.stride(0), out.stride(0), inter, hidden, eps,
        BLOCK=BLOCK, HIDDEN=1 << (hidden - 1).bit_length(),
    )  # fmt: skip
    return out
