"""Warm the L2 cache with the decode step's next weights (Hopper bulk prefetch; an experiment).

At batch 64 the decode step's matmuls read each weight once and are bound by latency, not bytes
(about 3.5 µs of fixed cost each, see the package README), while the attention before them streams
the KV cache. :func:`prefetch_l2` issues ``cp.async.bulk.prefetch.L2`` (sm_90: the copy engine
fetches a range into L2 and nobody waits for it) with an evict-last cache policy, from one small
Triton kernel launched on a side stream: the engine (``FastEngineConfig.prefetch_weights``) asks for
a layer's o / gate-up / down weights when the layer starts and for the next layer's QKV weight
after its o projection, and the attention then loads the KV cache with ``evict_first`` so that it
does not push those lines out. Nothing reads the kernel's result: a prefetch changes no value, only
where the next matmul finds its weight. ``benchmarks/gpu_generate.py`` times the step with and
without it in one process.

Compiles for sm_90+ only (the instruction does not exist before Hopper) and has no interpreter path:
:func:`usable` says whether it can run here.
"""

# ruff: noqa: PLR0913  (Triton kernels take their pointers and sizes as arguments)
from __future__ import annotations

import os
from collections.abc import Sequence
from functools import cache
from typing import Any

import torch

CHUNK = 65536  # bytes per bulk prefetch (a multiple of 16)
PER_PROGRAM = 128  # prefetches per program (one per thread of 4 warps)
MAX_RANGES = 4  # tensors per launch


def make_kernel() -> Any:
    """A fresh Triton kernel: grid ``(programs, ranges)``; range ``r`` starts ``off_r`` bytes after
    ``base_ptr`` and is ``n_r`` bytes long (``off_0 = 0``)."""
    import triton
    import triton.language as tl

    # arguments stay unannotated: @triton.jit reads annotations (tl.constexpr) to specialise a kernel
    @triton.jit
    def prefetch(base_ptr, off1, off2, off3, n0, n1, n2, n3, CHUNK: tl.constexpr, N: tl.constexpr):  # type: ignore[no-untyped-def]  # fmt: skip
        r = tl.program_id(1)
        off = tl.where(r == 1, off1, tl.where(r == 2, off2, tl.where(r == 3, off3, 0))).to(tl.int64)
        nbytes = tl.where(r == 0, n0, tl.where(r == 1, n1, tl.where(r == 2, n2, n3))).to(tl.int64)
        start = (tl.program_id(0) * N + tl.arange(0, N)).to(tl.int64) * CHUNK
        size = tl.minimum(tl.maximum(nbytes - start, 0), CHUNK) // 16 * 16
        # one bulk prefetch of $2 bytes at address $1 (none when $2 is 0), kept in L2 as evict-last;
        # the output register is a dummy (inline asm must produce a value)
        tl.inline_asm_elementwise(
            """{
            .reg .pred live;
            .reg .b64 policy;
            setp.gt.s32 live, $2, 0;
            createpolicy.fractional.L2::evict_last.b64 policy, 1.0;
            @live cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $2, policy;
            mov.u32 $0, 0;
            }""",
            "=r,l,r",
            [base_ptr + off + start, size.to(tl.int32)],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )

    return prefetch


@cache
def _kernel() -> Any:
    return make_kernel()


def usable(device: torch.device) -> bool:
    """Whether the prefetch kernel can run on ``device``: a CUDA device of compute capability 9.0
    or later, with Triton compiling for it (not the interpreter)."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.get_device_capability(device) >= (9, 0)


def prefetch_l2(tensors: Sequence[torch.Tensor], kernel: Any = None) -> None:
    """Ask L2 to fetch up to :data:`MAX_RANGES` tensors (each contiguous, 16-byte aligned) on the
    current stream; returns at once and changes no tensor."""
    if not 1 <= len(tensors) <= MAX_RANGES:
        raise ValueError(f"prefetch_l2 takes 1 to {MAX_RANGES} tensors, got {len(tensors)}")
    for t in tensors:
        if not t.is_contiguous() or t.data_ptr() % 16:
            raise ValueError(
                f"prefetch_l2 needs contiguous 16-byte aligned tensors, got shape {tuple(t.shape)}"
            )
    base = tensors[0].reshape(-1).view(torch.uint8)
    offsets = [t.data_ptr() - base.data_ptr() for t in tensors] + [0] * (MAX_RANGES - len(tensors))
    sizes = [t.numel() * t.element_size() for t in tensors] + [0] * (MAX_RANGES - len(tensors))
    programs = -(-max(sizes) // (CHUNK * PER_PROGRAM))
    (kernel or _kernel())[(programs, len(tensors))](
        base, *offsets[1:], *sizes, CHUNK=CHUNK, N=PER_PROGRAM, num_warps=PER_PROGRAM // 32
    )


def prefetch_on(side: torch.cuda.Stream, tensors: Sequence[torch.Tensor]) -> None:
    """:func:`prefetch_l2` on stream ``side`` once the work queued so far on the current stream has
    run (inside a graph capture: a fork the caller joins with ``wait_stream(side)``)."""
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        prefetch_l2(tensors)
