"""Split-K QKV projection for the fast engine's decode step: few rows, the weights streamed once.

At decode sizes (``M <= 64`` rows) a projection ``y = x Wᵀ`` (``W [N, K]``) is a weight stream with
next to no arithmetic, and its time is how long that stream takes to get going. For the QKV
projection (``N = (H + 2 KV) D``) cuBLAS picks a split-K kernel here and then spends a second launch
summing its splits (``splitKreduce_kernel``, 2.0 µs a layer on an H100 in
``benchmarks/results/gpu_generate_h100_profile.json``). This kernel splits ``K`` too: about
:data:`TARGET_PROGRAMS` programs each load one slice of ``K`` of one ``BN``-column tile, all of them
in flight at once, and each writes its float32 partial product, ``partials [S, M, N]``. The decode
attention's prologue, which reads its slice of the projection anyway, sums the ``S`` partials in a
fixed order as it loads them (:class:`.fast_attention.Prologue` with ``splits = S``), so the split
costs no launch and the sum is deterministic (no atomics).

An earlier use of this kernel for the o and down projections (commit 258837c) was faster per call
than cuBLAS on the H200 (4.6 -> 3.8 µs and 9.9 -> 7.1 µs) but gained nothing end to end, because
their partials had to be summed by the residual add + RMSNorm kernel, which grew by as much.

Kernels are built lazily by :func:`make_kernel` (``TRITON_INTERPRET=1`` then runs them on the CPU,
which is how the tests check them); :func:`splitk_linear` is the entry point.
"""

# ruff: noqa: PLR0913  (Triton kernels take their pointers, strides and sizes as arguments)
from __future__ import annotations

from functools import cache
from typing import Any

import torch

MAX_ROWS = 64  # above this the projections have enough rows for cuBLAS's own tiling
TARGET_PROGRAMS = 128  # about one program per SM of an H100/H200 (132)
BLOCK_N, BLOCK_K = 64, 128  # with LAUNCH the fastest of a sweep on the H200 (o and down projections)
LAUNCH = {"num_warps": 4, "num_stages": 3}


def make_kernel() -> Any:
    """A fresh Triton kernel (reads ``TRITON_INTERPRET`` now)."""
    import triton
    import triton.language as tl

    @triton.jit
    def splitk(x_ptr, w_ptr, p_ptr, M, N, K, sx, sw, k_per,
               BT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr):  # fmt: skip
        # weights as the dot's M side ([BN, BK] x [BK, BT]): the tensor-core tile's 64+ rows are
        # weight rows, the few token rows are its narrow side
        split = tl.program_id(1)
        n = tl.program_id(0) * BN + tl.arange(0, BN)
        t = tl.arange(0, BT)
        acc = tl.zeros([BN, BT], tl.float32)
        lo = split * k_per
        hi = tl.minimum(lo + k_per, K)
        for k0 in range(lo, hi, BK):
            k = k0 + tl.arange(0, BK)
            w = tl.load(
                w_ptr + n[:, None] * sw + k[None, :], mask=(n[:, None] < N) & (k[None, :] < hi), other=0.0
            )
            x = tl.load(
                x_ptr + t[None, :] * sx + k[:, None], mask=(t[None, :] < M) & (k[:, None] < hi), other=0.0
            )
            acc += tl.dot(w, x, input_precision=PREC)
        dst = p_ptr + (split * M + t[None, :]) * N + n[:, None]
        tl.store(dst, acc, mask=(t[None, :] < M) & (n[:, None] < N))

    return splitk


@cache
def _kernel() -> Any:
    return make_kernel()


def plan(n: int, k: int, target: int = TARGET_PROGRAMS) -> tuple[int, int]:
    """``(splits, k_per_split)`` for ``N`` outputs and reduction length ``K``: split ``K`` (in whole
    ``BLOCK_K`` steps) until the grid of ``BLOCK_N``-column tiles has about ``target`` programs."""
    steps = -(-k // BLOCK_K)
    splits = max(1, min(steps, target // max(1, -(-n // BLOCK_N))))
    k_per = -(-steps // splits) * BLOCK_K
    return -(-k // k_per), k_per


def splitk_linear(
    x: torch.Tensor, w: torch.Tensor, kernel: Any = None, target_programs: int = TARGET_PROGRAMS
) -> torch.Tensor:
    """``x [M, K]``, ``w [N, K]`` (rows of both unit-stride) -> float32 ``partials [S, M, N]`` with
    ``partials.sum(0) = x Wᵀ``."""
    import triton

    m = x.shape[0]
    n, k = w.shape
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"splitk_linear: x {tuple(x.shape)} does not fit w {tuple(w.shape)}")
    splits, k_per = plan(n, k, target=target_programs)
    partials = torch.empty(splits, m, n, device=x.device, dtype=torch.float32)
    (kernel or _kernel())[(triton.cdiv(n, BLOCK_N), splits)](
        x, w, partials, m, n, k, x.stride(0), w.stride(0), k_per,
        BT=max(16, triton.next_power_of_2(m)), BN=BLOCK_N, BK=BLOCK_K,
        PREC="ieee" if x.dtype == torch.float32 else "tf32", **LAUNCH,
    )  # fmt: skip
    return partials


def usable(device: torch.device, dtype: torch.dtype) -> str | None:
    """None if the kernel works here for ``dtype`` inputs (CUDA, and a self-check against a float64
    product of the same inputs passes), else why not."""
    if device.type != "cuda":
        return "not a CUDA device"
    try:
        import triton

        errors: tuple[type[BaseException], ...] = (
            RuntimeError,
            ImportError,
            ValueError,
            getattr(triton, "TritonError", RuntimeError),
        )
    except ImportError as exc:
        return repr(exc)
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(5, 300, generator=gen).to(device, dtype)
    w = (torch.randn(70, 300, generator=gen) / 300**0.5).to(device, dtype)
    try:
        got = splitk_linear(x, w, target_programs=8).sum(0)  # 3 splits, the last one shorter
    except errors as exc:
        return repr(exc)
    err = float((got.double() - x.double() @ w.double().T).abs().max())
    return None if err < 1e-3 else f"max abs error {err:.2e} against a float64 product"
