"""Weights into the L2 cache ahead of the matmuls that read them (the decode step's projections).

At decode batch sizes a projection is a small matmul (64 rows against a few MB of weights) that
cuBLAS runs well below the memory bandwidth: on an H100 the 0.37B shape's four projections of a
layer took 25 µs from DRAM and 19 µs with their weights already in L2
(``benchmarks/gpu_decode_gemm.py``: ``linear`` against ``linear_l2``). The decode attention before
them is the bandwidth-bound part of the layer. :func:`prefetch` asks the copy engine of each SM for
bulk L2 prefetches of whole tensors (Hopper's ``cp.async.bulk.prefetch.L2``, ``evict_last``
policy): launched on a side stream next to the attention, whose key/value loads are then
``evict_first``, it moves the weight reads into the attention's time without holding SMs (a
program issues its prefetches and exits; nothing is loaded into registers).

CUDA, sm_90 or newer only (the engine uses it only there); the tests check the instructions in the
kernel compiled for sm_90.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from typing import Any

import torch

CHUNK = 16384  # bytes per bulk prefetch (a multiple of 16)
LANES = 32  # prefetches a program issues at once
PROGRAMS = 8  # programs per tensor, by default


def make_kernel() -> Any:
    """A fresh Triton kernel."""
    import triton
    import triton.language as tl

    # arguments stay unannotated: @triton.jit reads annotations (tl.constexpr) to specialise a kernel
    @triton.jit
    def touch(x_ptr, nbytes, per_program, CHUNK: tl.constexpr, LANES: tl.constexpr):  # type: ignore[no-untyped-def]
        lo = tl.program_id(0).to(tl.int64) * per_program
        base = x_ptr.to(tl.pointer_type(tl.int8))
        for off in range(0, per_program, LANES * CHUNK):
            at = lo + off + tl.arange(0, LANES).to(tl.int64) * CHUNK
            size = (tl.minimum(tl.maximum(nbytes - at, 0), CHUNK) // 16 * 16).to(tl.int32)
            tl.inline_asm_elementwise(
                "{ .reg .pred p; .reg .b64 q; setp.gt.s32 p, $2, 0; "
                "createpolicy.fractional.L2::evict_last.b64 q, 1.0; "
                "@p cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $2, q; mov.u32 $0, 0; }",
                "=r,l,r",
                [base + at, size],
                dtype=tl.int32,
                is_pure=False,
                pack=1,
            )

    return touch


@cache
def _kernel() -> Any:
    return make_kernel()


def prefetch(tensors: Sequence[torch.Tensor], programs: int = PROGRAMS, kernel: Any = None) -> None:
    """Prefetch every byte of each contiguous CUDA tensor into L2 (``evict_last``), ``programs``
    programs per tensor."""
    touch = kernel or _kernel()
    for t in tensors:
        if not t.is_contiguous():
            raise ValueError(f"prefetch: tensor of shape {tuple(t.shape)} is not contiguous")
        nbytes = t.numel() * t.element_size()
        per = -(-nbytes // programs)
        per = -(-per // (LANES * CHUNK)) * LANES * CHUNK  # whole rounds of prefetches per program
        touch[(programs,)](t, nbytes, per, CHUNK=CHUNK, LANES=LANES, num_warps=1)
