"""The split-K tile matmul that :mod:`.fast_gemm` launches one task per program and
:mod:`.fast_chain` runs inside its persistent kernels (imported lazily, when one first runs:
``TRITON_INTERPRET`` is read at import)."""

# Triton kernels take every pointer, stride and size as a separate argument.
# ruff: noqa: PLR0913
# mypy: disable-error-code="no-untyped-def"

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def gemm_tasks(a_ptr, s_a, w_ptr, s_w, out_ptr, s_o, part_ptr, count_ptr, M, N, K, k_per_split,  # noqa: C901, PLR0915  (constexpr branches)
               pid, n_prog, EPILOGUE: tl.constexpr, SPLIT: tl.constexpr,
               BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
               ssq_ptr=None, eps=0.0, NORM: tl.constexpr = False):  # fmt: skip
    """``a [M, K] wᵀ`` (``w [N, K]`` rows ``s_w`` apart) with epilogue ``store`` (0), ``residual``
    (1: ``out +=``) or ``swiglu`` (2: ``w = [W_gate; W_up]``, ``N`` outputs from ``2N`` rows); with
    ``NORM`` swiglu scales both halves by ``r = 1 / rms(a)`` (the norm weight folded into ``w``),
    the sum of squares taken from the same loads of ``a``.

    The work is cut into tasks, (output tile of ``BM × BN``, range ``split`` of K), task =
    ``split · tiles + tile``; program ``pid`` of ``n_prog`` runs tasks ``pid, pid + n_prog, ...``.
    Where K is split, each task writes its float32 partial and counts on its tile's counter; the
    last to count sums the partials in split order (deterministic), applies the epilogue and
    resets the counter to 0."""
    n_cols = tl.cdiv(N, BN)
    n_tiles = tl.cdiv(M, BM) * n_cols
    rk = tl.arange(0, BK)
    cell = tl.arange(0, BM)[:, None] * BN + tl.arange(0, BN)[None, :]
    parts = 2 if EPILOGUE == 2 else 1
    for task in range(pid, n_tiles * SPLIT, n_prog):
        tile = task % n_tiles
        split = task // n_tiles
        rm = (tile // n_cols) * BM + tl.arange(0, BM)
        rn = (tile % n_cols) * BN + tl.arange(0, BN)
        m_ok = rm < M
        n_ok = rn < N
        acc = tl.zeros((BM, BN), tl.float32)
        acc_up = tl.zeros((BM, BN), tl.float32)
        ssq = tl.zeros((BM,), tl.float32)
        k_begin = split * k_per_split
        for k0 in range(k_begin, tl.minimum(k_begin + k_per_split, K), BK):
            k = k0 + rk
            k_ok = k < K
            a = tl.load(
                a_ptr + rm[:, None] * s_a + k[None, :],
                mask=m_ok[:, None] & k_ok[None, :], other=0.0, cache_modifier=".cg",
            )  # fmt: skip
            w_mask = n_ok[None, :] & k_ok[:, None]
            w = tl.load(w_ptr + rn[None, :].to(tl.int64) * s_w + k[:, None], mask=w_mask, other=0.0)
            acc = tl.dot(a, w, acc)
            if EPILOGUE == 2:
                up = tl.load(
                    w_ptr + (rn[None, :] + N).to(tl.int64) * s_w + k[:, None], mask=w_mask, other=0.0
                )
                acc_up = tl.dot(a, up, acc_up)
                if NORM:
                    af = a.to(tl.float32)
                    ssq += tl.sum(af * af, axis=1)
        last = True
        if SPLIT > 1:
            mine = (split * n_tiles + tile).to(tl.int64) * parts
            tl.store(part_ptr + mine * BM * BN + cell, acc)
            if EPILOGUE == 2:
                tl.store(part_ptr + (mine + 1) * BM * BN + cell, acc_up)
            if NORM:
                tl.store(ssq_ptr + (split * n_tiles + tile).to(tl.int64) * BM + tl.arange(0, BM), ssq)
            tl.debug_barrier()
            last = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu") == SPLIT - 1
            if last:
                acc = tl.zeros((BM, BN), tl.float32)
                acc_up = tl.zeros((BM, BN), tl.float32)
                ssq = tl.zeros((BM,), tl.float32)
                for s in tl.static_range(SPLIT):
                    theirs = (s * n_tiles + tile).to(tl.int64) * parts
                    acc += tl.load(part_ptr + theirs * BM * BN + cell, cache_modifier=".cg")
                    if EPILOGUE == 2:
                        acc_up += tl.load(part_ptr + (theirs + 1) * BM * BN + cell, cache_modifier=".cg")
                    if NORM:
                        ssq += tl.load(
                            ssq_ptr + (s * n_tiles + tile).to(tl.int64) * BM + tl.arange(0, BM),
                            cache_modifier=".cg",
                        )
                tl.store(count_ptr + tile, 0)  # every split has counted: ready for the next call
        if last:
            out_at = out_ptr + rm[:, None].to(tl.int64) * s_o + rn[None, :]
            o_mask = m_ok[:, None] & n_ok[None, :]
            if EPILOGUE == 1:
                acc += tl.load(out_at, mask=o_mask, other=0.0, cache_modifier=".cg").to(tl.float32)
            if EPILOGUE == 2:
                if NORM:
                    r = 1.0 / tl.sqrt(ssq / K + eps)
                    acc = acc * r[:, None]
                    acc_up = acc_up * r[:, None]
                acc = acc / (1.0 + tl.exp(-acc)) * acc_up
            tl.store(out_at, acc.to(out_ptr.dtype.element_ty), mask=o_mask)


@triton.jit
def skinny_gemm(a_ptr, w_ptr, out_ptr, part_ptr, ssq_ptr, count_ptr, M, N, K, s_am, s_wn, s_om,
                k_per_split, eps, EPILOGUE: tl.constexpr, SPLIT: tl.constexpr,
                BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):  # fmt: skip
    """:func:`gemm_tasks` on grid ``(tiles, SPLIT)``: one task per program; swiglu with the norm."""
    pid = tl.program_id(0) + tl.program_id(1) * tl.num_programs(0)
    gemm_tasks(a_ptr, s_am, w_ptr, s_wn, out_ptr, s_om, part_ptr, count_ptr, M, N, K, k_per_split,
               pid, tl.num_programs(0) * tl.num_programs(1), EPILOGUE, SPLIT, BM, BN, BK,
               ssq_ptr, eps, EPILOGUE == 2)  # fmt: skip
