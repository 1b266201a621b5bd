"""The decode step's attention prologue as one Triton kernel: split the fused QKV projection,
rotate q and k (RoPE, HF "rotate half" layout) and write k and v into cache slot ``slot``.

Unfused that is a split, two rotary kernels, a ``contiguous`` and two ``index_copy_`` per layer —
six tiny launches whose fixed cost dominates at decode sizes (a few microseconds each against
kilobytes of data). The unshared decode path leaves this work to the attention kernel itself
(:class:`.fast_attention.Prologue`); this kernel serves the shared-prompt path. It also applies the input norm's ``1 / rms(x)`` (whose weight is folded into the
projection, :mod:`.fast_weights`) and the QKV bias, so the layer needs no norm kernel. Grid
``(b, (H + 2 KV) / PER_PROGRAM)``: program ``(r, c)`` moves heads ``c PER .. (c + 1) PER - 1`` of
row ``r`` (query heads first, then key heads, then value heads), ``D`` values each.

:func:`rope_store` is the entry point; :func:`rope_store_reference` is the same in plain torch
(the engine's CPU path and the tests' reference). Kernels are built lazily (``TRITON_INTERPRET=1``
then runs them on the CPU, which is how the tests check them).
"""

# ruff: noqa: PLR0913  (Triton kernels take their pointers, strides and sizes as arguments)
from __future__ import annotations

from functools import cache
from typing import Any

import torch

PER_PROGRAM = 8  # heads per program: the row's 1 / rms(x) is computed once for them


def make_kernel() -> Any:
    """A fresh Triton kernel (reads ``TRITON_INTERPRET`` now)."""
    import triton
    import triton.language as tl

    # arguments stay unannotated: @triton.jit reads annotations (tl.constexpr) to specialise a kernel
    @triton.jit
    def prologue(qkv_ptr, cos_ptr, sin_ptr, q_ptr, kc_ptr, vc_ptr, slot_ptr, x_ptr, bias_ptr,  # type: ignore[no-untyped-def]
                 s_qkv, s_cos, s_sin, s_cb, s_ch, s_ct, s_x, heads, kv_heads, hidden, eps,
                 D: tl.constexpr, HALF: tl.constexpr, PER: tl.constexpr, NORM: tl.constexpr,
                 HIDDEN: tl.constexpr, HAS_BIAS: tl.constexpr):  # fmt: skip
        r = tl.program_id(0).to(tl.int64)
        j = tl.program_id(1) * PER + tl.arange(0, PER)[:, None]  # [PER, 1] heads of this program
        d = tl.arange(0, HALF)[None, :]
        live = (j < heads + 2 * kv_heads) & (d < HALF)
        slot = tl.load(slot_ptr).to(tl.int64)
        src = qkv_ptr + r * s_qkv + j * D + d
        x1 = tl.load(src, mask=live, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF, mask=live, other=0.0).to(tl.float32)
        if NORM:  # 1 / rms of the row's residual stream (its norm weight is folded into W_qkv)
            e = tl.arange(0, HIDDEN)
            xr = tl.load(x_ptr + r * s_x + e, mask=e < hidden, other=0.0).to(tl.float32)
            scale = 1.0 / tl.sqrt(tl.sum(xr * xr, axis=0) / hidden + eps)
            x1, x2 = x1 * scale, x2 * scale
        if HAS_BIAS:
            x1 += tl.load(bias_ptr + j * D + d, mask=live, other=0.0).to(tl.float32)
            x2 += tl.load(bias_ptr + j * D + HALF + d, mask=live, other=0.0).to(tl.float32)
        c1 = tl.load(cos_ptr + r * s_cos + d).to(tl.float32)
        c2 = tl.load(cos_ptr + r * s_cos + HALF + d).to(tl.float32)
        s1 = tl.load(sin_ptr + r * s_sin + d).to(tl.float32)
        s2 = tl.load(sin_ptr + r * s_sin + HALF + d).to(tl.float32)
        rotate = j < heads + kv_heads  # q and k heads; v heads are copied as they are
        y1 = tl.where(rotate, x1 * c1 - x2 * s1, x1)
        y2 = tl.where(rotate, x2 * c2 + x1 * s2, x2)
        kv = tl.where(j < heads + kv_heads, j - heads, j - heads - kv_heads)  # index among k (or v) heads
        cache = r * s_cb + kv * s_ch + slot * s_ct
        dst = tl.where(
            j < heads, q_ptr + (r * heads + j) * D, tl.where(rotate, kc_ptr + cache, vc_ptr + cache)
        )
        tl.store(dst + d, y1.to(q_ptr.dtype.element_ty), mask=live)
        tl.store(dst + HALF + d, y2.to(q_ptr.dtype.element_ty), mask=live)

    return prologue


@cache
def _kernel() -> Any:
    return make_kernel()


def supported(head_dim: int) -> bool:
    """The kernel needs an even head size whose half is a power of two (a Triton block)."""
    half = head_dim // 2
    return head_dim % 2 == 0 and half > 0 and half & (half - 1) == 0


def rope_store(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot: torch.Tensor,
    kv_heads: int,
    head_dim: int,
    x: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 0.0,
    kernel: Any = None,
) -> torch.Tensor:
    """``qkv [b, (H + 2 KV) D]`` (rows unit-stride), ``cos/sin [b, D]``, caches ``[b, KV, T, D]``
    (one layer, last dim contiguous, same strides), ``slot`` 0-d -> ``q [b, KV, G, D]`` rotated;
    rotated k and v are written to ``k_cache[:, :, slot]`` and ``v_cache[:, :, slot]``.

    With ``x [b, hidden]`` (rows unit-stride), ``qkv`` is the projection of the un-normalised
    residual stream ``x`` by the norm-folded weight and is first scaled by ``1 / rms(x)`` (see
    :mod:`.fast_weights`); ``bias [(H + 2 KV) D]`` is then added."""
    b, width = qkv.shape
    heads = width // head_dim - 2 * kv_heads
    q = qkv.new_empty(b, heads * head_dim)
    sc = k_cache.stride()
    per = PER_PROGRAM
    hidden = 1 if x is None else x.shape[1]
    (kernel or _kernel())[(b, -(-(heads + 2 * kv_heads) // per))](
        qkv, cos, sin, q, k_cache, v_cache, slot, qkv if x is None else x, qkv if bias is None else bias,
        qkv.stride(0), cos.stride(0), sin.stride(0), sc[0], sc[1], sc[2], 0 if x is None else x.stride(0),
        heads, kv_heads, hidden, eps, D=head_dim, HALF=head_dim // 2, PER=per, NORM=x is not None,
        HIDDEN=1 << (hidden - 1).bit_length(), HAS_BIAS=bias is not None,
    )  # fmt: skip
    return q.view(b, kv_heads, heads // kv_heads, head_dim)


def rope_store_reference(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot: torch.Tensor,
    kv_heads: int,
    head_dim: int,
    split_rope: Any = None,
) -> torch.Tensor:
    """:func:`rope_store` in torch (``split_rope``: the engine's possibly compiled split + rotate)."""
    from megalith_chat.engine.fast_ops import split_rope_decode

    q, k, v = (split_rope or split_rope_decode)(qkv, cos, sin, kv_heads, head_dim)
    index = slot.view(1)
    k_cache.index_copy_(2, index, k)
    v_cache.index_copy_(2, index, v)
    return q
