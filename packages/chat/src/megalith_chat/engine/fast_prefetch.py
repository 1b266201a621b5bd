"""Weights into the L2 cache ahead of the matmuls that read them (the decode step's projections).

At decode batch sizes a projection is a small matmul (64 rows against a few MB of weights) that
cuBLAS runs well below the memory bandwidth: on an H100 the 0.37B shape's four projections of a
layer took 25 µs from DRAM and 19 µs with their weights already in L2
(``benchmarks/gpu_decode_gemm.py``: ``linear`` against ``linear_l2``). The decode attention before
them is the bandwidth-bound part of the layer. :func:`prefetch` reads tensors with the
``evict_last`` cache policy and sums them into a scratch buffer (so the loads are kept): launched on
a side stream next to the attention, whose key/value loads are then ``evict_first``, it moves the
weight reads into the attention's time.

Grid: ``programs`` programs per tensor, each summing a contiguous slice into
``scratch[tensor, program]``. Built lazily (``TRITON_INTERPRET=1`` runs it on the CPU, which is how
the tests check that every element is read).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from typing import Any

import torch

BLOCK = 4096  # elements per load


def make_kernel() -> Any:
    """A fresh Triton kernel (reads ``TRITON_INTERPRET`` now)."""
    import triton
    import triton.language as tl

    # arguments stay unannotated: @triton.jit reads annotations (tl.constexpr) to specialise a kernel
    @triton.jit
    def touch(x_ptr, out_ptr, numel, per_program, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
        pid = tl.program_id(0)
        lo = pid.to(tl.int64) * per_program
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for off in range(0, per_program, BLOCK):
            i = lo + off + tl.arange(0, BLOCK)
            acc += tl.load(x_ptr + i, mask=i < numel, other=0.0, eviction_policy="evict_last").to(tl.float32)
        tl.store(out_ptr + pid, tl.sum(acc, axis=0))

    return touch


@cache
def _kernel() -> Any:
    return make_kernel()


def scratch(tensors: int, programs: int, device: torch.device) -> torch.Tensor:
    """The buffer :func:`prefetch` writes: ``[tensors, programs]`` float32."""
    return torch.empty(tensors, programs, dtype=torch.float32, device=device)


def prefetch(tensors: Sequence[torch.Tensor], out: torch.Tensor, kernel: Any = None) -> None:
    """Read every element of each (contiguous) tensor through L2 with ``evict_last``; ``out
    [len(tensors), programs]`` gets each program's sum of its slice (row ``t`` sums to tensor ``t``'s
    sum)."""
    programs = out.shape[1]
    touch = kernel or _kernel()
    for t, row in zip(tensors, out):
        if not t.is_contiguous():
            raise ValueError(f"prefetch: tensor of shape {tuple(t.shape)} is not contiguous")
        per = -(-t.numel() // programs)
        per = -(-per // BLOCK) * BLOCK  # whole blocks per program
        touch[(programs,)](t, row, t.numel(), per, BLOCK=BLOCK)
