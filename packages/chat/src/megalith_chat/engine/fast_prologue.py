"""The decode step's attention prologue as one Triton kernel: split the fused QKV projection,
rotate q and k (RoPE, HF "rotate half" layout) and write k and v into cache slot ``slot``.

Unfused that is a split, two rotary kernels, a ``contiguous`` and two ``index_copy_`` per layer —
six tiny launches whose fixed cost dominates at decode sizes (a few microseconds each against
kilobytes of data). Grid ``(b, H + 2 KV)``: program ``(r, j)`` moves head ``j`` of row ``r``
(query heads first, then key heads, then value heads), ``D`` values.

:func:`rope_store` is the entry point; :func:`rope_store_reference` is the same in plain torch
(the engine's CPU path and the tests' reference). Kernels are built lazily (``TRITON_INTERPRET=1``
then runs them on the CPU, which is how the tests check them).
"""

# ruff: noqa: PLR0913  (Triton kernels take their pointers, strides and sizes as arguments)
from __future__ import annotations

from functools import cache
from typing import Any

import torch


def make_kernel() -> Any:
    """A fresh Triton kernel (reads ``TRITON_INTERPRET`` now)."""
    import triton
    import triton.language as tl

    @triton.jit
    def prologue(qkv_ptr, cos_ptr, sin_ptr, q_ptr, kc_ptr, vc_ptr, slot_ptr,
                 s_qkv, s_cos, s_sin, s_cb, s_ch, s_ct, heads, kv_heads,
                 D: tl.constexpr, HALF: tl.constexpr):  # fmt: skip
        r = tl.program_id(0).to(tl.int64)
        j = tl.program_id(1)
        d = tl.arange(0, HALF)
        src = qkv_ptr + r * s_qkv + j * D
        x1 = tl.load(src + d).to(tl.float32)
        x2 = tl.load(src + HALF + d).to(tl.float32)
        slot = tl.load(slot_ptr).to(tl.int64)
        if j < heads + kv_heads:  # q or k: rotate
            c1 = tl.load(cos_ptr + r * s_cos + d).to(tl.float32)
            c2 = tl.load(cos_ptr + r * s_cos + HALF + d).to(tl.float32)
            s1 = tl.load(sin_ptr + r * s_sin + d).to(tl.float32)
            s2 = tl.load(sin_ptr + r * s_sin + HALF + d).to(tl.float32)
            y1 = x1 * c1 - x2 * s1
            y2 = x2 * c2 + x1 * s2
            if j < heads:
                dst = q_ptr + (r * heads + j) * D
            else:
                dst = kc_ptr + r * s_cb + (j - heads) * s_ch + slot * s_ct
            tl.store(dst + d, y1.to(dst.dtype.element_ty))
            tl.store(dst + HALF + d, y2.to(dst.dtype.element_ty))
        else:  # v: copy into the cache
            dst = vc_ptr + r * s_cb + (j - heads - kv_heads) * s_ch + slot * s_ct
            tl.store(dst + d, x1.to(dst.dtype.element_ty))
            tl.store(dst + HALF + d, x2.to(dst.dtype.element_ty))

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
    kernel: Any = None,
) -> torch.Tensor:
    """``qkv [b, (H + 2 KV) D]`` (rows unit-stride), ``cos/sin [b, D]``, caches ``[b, KV, T, D]``
    (one layer, last dim contiguous, same strides), ``slot`` 0-d -> ``q [b, KV, G, D]`` rotated;
    rotated k and v are written to ``k_cache[:, :, slot]`` and ``v_cache[:, :, slot]``."""
    b, width = qkv.shape
    heads = width // head_dim - 2 * kv_heads
    q = qkv.new_empty(b, heads * head_dim)
    sc = k_cache.stride()
    (kernel or _kernel())[(b, heads + 2 * kv_heads)](
        qkv, cos, sin, q, k_cache, v_cache, slot, qkv.stride(0), cos.stride(0), sin.stride(0),
        sc[0], sc[1], sc[2], heads, kv_heads, D=head_dim, HALF=head_dim // 2,
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
