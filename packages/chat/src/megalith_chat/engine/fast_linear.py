"""Split-K projections for the fast engine's decode step: few rows, the weights streamed once.

At decode sizes (``M <= 64`` rows) a projection ``y = x Wᵀ`` (``W [N, K]``) is a weight stream with
next to no arithmetic, and its time is how long that stream takes to get going. Tiling ``N`` alone,
as cuBLAS does here, leaves each of a few dozen thread blocks walking all of ``K`` one tile after
another. This kernel splits ``K`` as well: about :data:`TARGET_PROGRAMS` programs each load one
slice of ``K`` of one ``BN``-column tile, all of them in flight at once, and each writes its float32
partial product, ``partials [S, M, N]``. Whoever consumes ``y`` sums the ``S`` partials in a fixed
order (deterministic, unlike atomics) inside a kernel it runs anyway (the engine's compiled
residual add + RMSNorm), so the split costs no launch. Graph-replayed over 24 layers of weights on
the H200 (0.37B shape, 64 rows, ``benchmarks/results/gpu_generate_h200_splitk.json``): the attention
output projection (``N = K = 1024``) 4.6 -> 3.8 µs, the MLP down projection (``K = 2816``, with
the SwiGLU kernel before it) 9.8 -> 7.0 µs against cuBLAS. Forming ``silu(gate) * up`` inside this
kernel instead, as it loads its input, was slower (12.3 µs): every program reads twice the input.

Kernels are built lazily by :func:`make_kernel` (``TRITON_INTERPRET=1`` then runs them on the CPU,
which is how the tests check them); :func:`splitk_linear` is the entry point.
"""

# ruff: noqa: PLR0913  (Triton kernels take their pointers, strides and sizes as arguments)
from __future__ import annotations

import logging
from functools import cache
from typing import Any

import torch

logger = logging.getLogger(__name__)

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


def make_norm_kernel() -> Any:
    """A fresh Triton kernel for :func:`add_partials_rms_norm` (reads ``TRITON_INTERPRET`` now)."""
    import triton
    import triton.language as tl

    @triton.jit
    def add_norm(p_ptr, b_ptr, x_ptr, w_ptr, xo_ptr, ho_ptr, M, N, sx, eps, splits,
                 BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr):  # fmt: skip
        r = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        ok = cols < N
        acc = tl.zeros([BLOCK], tl.float32)
        for s in range(splits):  # fixed order: deterministic
            acc += tl.load(p_ptr + (s * M + r) * N + cols, mask=ok, other=0.0)
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + r * sx + cols, mask=ok, other=0.0)
        dtype = x.dtype
        # rounded where torch rounds: the projection's output, the residual sum, the normed value
        total = (x.to(tl.float32) + acc.to(dtype).to(tl.float32)).to(dtype)
        tl.store(xo_ptr + r * N + cols, total, mask=ok)
        t = total.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(t * t, axis=0) / N + eps)
        w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        h = w * (t * rstd).to(dtype).to(tl.float32)
        tl.store(ho_ptr + r * N + cols, h.to(dtype), mask=ok)

    return add_norm


@cache
def _kernel() -> Any:
    return make_kernel()


@cache
def _norm_kernel() -> Any:
    return make_norm_kernel()


def add_partials_rms_norm(
    x: torch.Tensor,
    partials: torch.Tensor,
    bias: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    kernel: Any = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The consumer of :func:`splitk_linear`: ``delta = sum_s partials[s] (+ bias)`` rounded to
    ``x``'s dtype, then ``(x + delta, rms_norm(x + delta) * weight)`` as the engine's
    ``fast_ops.add_partials_rms_norm`` computes them, in one kernel (one program per row). A
    hand-written kernel, not a compiled torch function: Inductor's choice for this reduction over
    the split axis varied between processes (2.5 to 6.5 µs per call on the H200)."""
    import triton

    m, n = x.shape
    x_out, h_out = (
        torch.empty(m, n, device=x.device, dtype=x.dtype),
        torch.empty(m, n, device=x.device, dtype=x.dtype),
    )
    (kernel or _norm_kernel())[(m,)](
        partials, bias if bias is not None else weight, x, weight, x_out, h_out, m, n, x.stride(0), eps,
        partials.shape[0], BLOCK=triton.next_power_of_2(n), HAS_BIAS=bias is not None, num_warps=4,
    )  # fmt: skip
    return x_out, h_out


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
