"""The Triton kernels of :mod:`.fast_chain` (imported lazily, when one first runs:
``TRITON_INTERPRET`` is read at import). The prefetch helpers use inline PTX, so they compile
for CUDA only; the interpreter runs the kernels with them off."""

# Triton kernels take every pointer, stride and size as a separate argument.
# ruff: noqa: PLR0913
# mypy: disable-error-code="no-untyped-def"

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def grid_sync(bar_ptr, err_ptr, target, SPIN: tl.constexpr):
    """Arrive at the barrier counter (release) and poll it (acquire) until it reaches ``target``
    arrivals, or flag ``err_ptr`` after ``SPIN`` polls."""
    tl.debug_barrier()  # this program's stores are issued before it arrives
    seen = tl.atomic_add(bar_ptr, 1, sem="release", scope="gpu") + 1
    spins = tl.full((), 0, tl.int32)
    while (seen < target) & (spins < SPIN):
        seen = tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
        spins += 1
    if seen < target:
        tl.atomic_max(err_ptr, 1)
    tl.debug_barrier()


@triton.jit
def phase(a_ptr, s_a, w_ptr, out_ptr, s_o, part_ptr, count_ptr, M, N, K, k_per_split,  # noqa: C901  (constexpr branches)
          pid, n_prog, EPILOGUE: tl.constexpr, SPLIT: tl.constexpr,
          BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
          ssq_ptr=None, eps=0.0, NORM: tl.constexpr = False):  # fmt: skip
    """One projection: ``store`` (0), ``residual`` (1) or ``swiglu`` (2) of ``a wᵀ``; with ``NORM``
    swiglu scales both halves by ``r = 1 / rms(a)`` (the norm weight folded into ``w``), the sum
    of squares taken from the same loads of ``a`` (K must then be the full row)."""
    n_tiles = tl.cdiv(N, BN)
    rm = tl.arange(0, BM)
    rk = tl.arange(0, BK)
    m_ok = rm < M
    cell = rm[:, None] * BN + tl.arange(0, BN)[None, :]
    parts = 2 if EPILOGUE == 2 else 1
    for task in range(pid, n_tiles * SPLIT, n_prog):
        tile = task % n_tiles
        split = task // n_tiles
        rn = tile * BN + tl.arange(0, BN)
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
            w = tl.load(w_ptr + rn[None, :].to(tl.int64) * K + k[:, None], mask=w_mask, other=0.0)
            acc = tl.dot(a, w, acc)
            if EPILOGUE == 2:
                up = tl.load(w_ptr + (rn[None, :] + N).to(tl.int64) * K + k[:, None], mask=w_mask, other=0.0)
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
                tl.store(ssq_ptr + (split * n_tiles + tile).to(tl.int64) * BM + rm, ssq)
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
                            ssq_ptr + (s * n_tiles + tile).to(tl.int64) * BM + rm, cache_modifier=".cg"
                        )
                tl.store(count_ptr + tile, 0)  # every split has counted: ready for the next layer
        if last:
            out_at = out_ptr + rm[:, None] * s_o + rn[None, :]
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
def bulk_prefetch(ptrs, nbytes):
    """Ask L2 for ``nbytes`` at each of ``ptrs`` (Hopper bulk prefetch; 16-byte multiples)."""
    tl.inline_asm_elementwise(
        "mov.b32 $0, 0; cp.async.bulk.prefetch.L2.global [$1], $2;", "=r,l,r",
        [ptrs, nbytes], dtype=tl.int32, is_pure=False, pack=1,
    )  # fmt: skip


@triton.jit
def prefetch(w_ptr, N, K, k_per_split, pid, n_prog, SPLIT: tl.constexpr, BN: tl.constexpr, UP: tl.constexpr,
             PIECES: tl.constexpr = 8):  # fmt: skip
    """Ask L2 for the weight rows of this program's tasks of a projection (``phase``'s cut; with
    ``UP`` also the up half): each row's range in ``PIECES`` bulk prefetches, so that the
    ``[BN, PIECES]`` requests spread over the threads instead of repeating on every warp. Fire and
    forget: nothing waits on them."""
    n_tiles = tl.cdiv(N, BN)
    piece = tl.arange(0, PIECES)
    for task in range(pid, n_tiles * SPLIT, n_prog):
        tile = task % n_tiles
        k0 = (task // n_tiles) * k_per_split
        k_len = tl.minimum(k_per_split, K - k0)
        chunk = tl.cdiv(k_len, PIECES * 8) * 8  # elements per piece: 16-byte multiples (bf16)
        start = piece * chunk
        size = tl.minimum(tl.maximum(k_len - start, 0), chunk)
        live = size > 0
        start = tl.where(live, start, 0)  # a piece past the range asks for the first one again
        size = tl.where(live, size, tl.minimum(chunk, k_len))
        rn = tile * BN + tl.arange(0, BN)
        rows = tl.where(rn < N, rn, 0).to(tl.int64)
        nbytes = tl.broadcast_to(size[None, :] * 2, (BN, PIECES))
        for half in tl.static_range(2 if UP else 1):
            bulk_prefetch(w_ptr + (rows[:, None] + half * N) * K + k0 + start[None, :], nbytes)


@triton.jit
def prefetch_idle(w_ptr, numel, tasks, pid, n_prog, PIECES: tl.constexpr = 128):
    """Programs with no task in this projection (``pid >= tasks``) share out the ``numel`` bf16
    elements at ``w_ptr`` (a later projection's weights, contiguous) and ask L2 for their share,
    ``PIECES`` bulk prefetches each."""
    if (pid >= tasks) & (n_prog > tasks):
        share = tl.cdiv(tl.cdiv(numel, n_prog - tasks), PIECES * 8) * PIECES * 8
        piece = share // PIECES
        start = (pid - tasks) * share + tl.arange(0, PIECES) * piece
        size = tl.minimum(tl.maximum(numel - start, 0), piece)
        live = size > 0
        start = tl.where(live, start, 0)  # a piece past the end asks for the first one again
        size = tl.where(live, size, tl.minimum(piece, numel))
        bulk_prefetch(w_ptr + start.to(tl.int64), size * 2)


@triton.jit
def prefetch_ahead(P: tl.constexpr, D: tl.constexpr, layer, layers, wq, wo, wgu, wd, hidden, inter,
                   KP0, KP1, KP2, KP3, pid, n_prog,
                   SP0: tl.constexpr, SP1: tl.constexpr, SP2: tl.constexpr, SP3: tl.constexpr,
                   BN0: tl.constexpr, BN1: tl.constexpr, BN2: tl.constexpr, BN3: tl.constexpr):  # fmt: skip
    """As projection P (0 qkv, 1 o, 2 gate/up, 3 down) of ``layer`` starts: prefetch this
    program's weights of the projection D ahead (possibly in a later layer), if there is one."""
    if D > 0:
        ahead = (P + D) // 4  # layers ahead
        if layer + ahead < layers:
            if (P + D) % 4 == 0:
                prefetch(
                    wq + ahead * 3 * hidden * hidden, 3 * hidden, hidden, KP0, pid, n_prog, SP0, BN0, False
                )
            if (P + D) % 4 == 1:
                prefetch(wo + ahead * hidden * hidden, hidden, hidden, KP1, pid, n_prog, SP1, BN1, False)
            if (P + D) % 4 == 2:
                prefetch(wgu + ahead * 2 * inter * hidden, inter, hidden, KP2, pid, n_prog, SP2, BN2, True)
            if (P + D) % 4 == 3:
                prefetch(wd + ahead * hidden * inter, hidden, inter, KP3, pid, n_prog, SP3, BN3, False)


@triton.jit
def chain(x_ptr, t_ptr, s_ptr, wqkv_ptr, wo_ptr, wgu_ptr, wd_ptr, part_ptr, count_ptr,
          bar_ptr, err_ptr, M, layers, hidden, inter,
          KP0, KP1, KP2, KP3,
          SP0: tl.constexpr, SP1: tl.constexpr, SP2: tl.constexpr, SP3: tl.constexpr,
          BN0: tl.constexpr, BN1: tl.constexpr, BN2: tl.constexpr, BN3: tl.constexpr,
          BM: tl.constexpr, BK: tl.constexpr, SPIN: tl.constexpr, PREFETCH: tl.constexpr,
          IDLE: tl.constexpr = False):  # fmt: skip
    """PREFETCH = D > 0: as each projection starts, a program asks L2 for its weights of the
    projection D ahead (1: the next; 4: the same one of the next layer). IDLE: the programs
    without a task in qkv ask L2 for this layer's o and gate/up weights, those without one in
    gate/up for its down and the next layer's qkv weights."""
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    c1 = count_ptr + tl.cdiv(3 * hidden, BN0)  # each projection's tile counters
    c2 = c1 + tl.cdiv(hidden, BN1)
    c3 = c2 + tl.cdiv(inter, BN2)
    wq, wo, wgu, wd = wqkv_ptr, wo_ptr, wgu_ptr, wd_ptr  # this layer's weights
    arrived = n_prog * 0  # barrier arrivals so far, over the whole launch
    for layer in range(layers):
        if IDLE:
            tasks0 = tl.cdiv(3 * hidden, BN0) * SP0
            prefetch_idle(wo, hidden * hidden, tasks0, pid, n_prog)
            prefetch_idle(wgu, 2 * inter * hidden, tasks0, pid, n_prog)
        prefetch_ahead(0, PREFETCH, layer, layers, wq, wo, wgu, wd, hidden, inter, KP0, KP1, KP2, KP3,
                       pid, n_prog, SP0, SP1, SP2, SP3, BN0, BN1, BN2, BN3)  # fmt: skip
        phase(x_ptr, hidden, wq, t_ptr, 3 * hidden, part_ptr, count_ptr, M, 3 * hidden, hidden, KP0,
              pid, n_prog, 0, SP0, BM, BN0, BK)  # fmt: skip
        arrived += n_prog
        grid_sync(bar_ptr, err_ptr, arrived, SPIN)
        prefetch_ahead(1, PREFETCH, layer, layers, wq, wo, wgu, wd, hidden, inter, KP0, KP1, KP2, KP3,
                       pid, n_prog, SP0, SP1, SP2, SP3, BN0, BN1, BN2, BN3)  # fmt: skip
        phase(t_ptr, 3 * hidden, wo, x_ptr, hidden, part_ptr, c1, M, hidden, hidden, KP1,
              pid, n_prog, 1, SP1, BM, BN1, BK)  # fmt: skip
        arrived += n_prog
        grid_sync(bar_ptr, err_ptr, arrived, SPIN)
        if IDLE:
            tasks2 = tl.cdiv(inter, BN2) * SP2
            prefetch_idle(wd, hidden * inter, tasks2, pid, n_prog)
            if layer + 1 < layers:
                prefetch_idle(wq + 3 * hidden * hidden, 3 * hidden * hidden, tasks2, pid, n_prog)
        prefetch_ahead(2, PREFETCH, layer, layers, wq, wo, wgu, wd, hidden, inter, KP0, KP1, KP2, KP3,
                       pid, n_prog, SP0, SP1, SP2, SP3, BN0, BN1, BN2, BN3)  # fmt: skip
        phase(x_ptr, hidden, wgu, s_ptr, inter, part_ptr, c2, M, inter, hidden, KP2,
              pid, n_prog, 2, SP2, BM, BN2, BK)  # fmt: skip
        arrived += n_prog
        grid_sync(bar_ptr, err_ptr, arrived, SPIN)
        prefetch_ahead(3, PREFETCH, layer, layers, wq, wo, wgu, wd, hidden, inter, KP0, KP1, KP2, KP3,
                       pid, n_prog, SP0, SP1, SP2, SP3, BN0, BN1, BN2, BN3)  # fmt: skip
        phase(s_ptr, inter, wd, x_ptr, hidden, part_ptr, c3, M, hidden, inter, KP3,
              pid, n_prog, 1, SP3, BM, BN3, BK)  # fmt: skip
        arrived += n_prog
        grid_sync(bar_ptr, err_ptr, arrived, SPIN)
        wq += 3 * hidden * hidden
        wo += hidden * hidden
        wgu += 2 * inter * hidden
        wd += hidden * inter


@triton.jit
def mlp_block(attn_ptr, x_ptr, s_ptr, wo_ptr, wgu_ptr, wd_ptr, part_ptr, ssq_ptr, count_ptr,
              sync_ptr, M, hidden, inter, q_width, eps, KP1, KP2, KP3,
              SP1: tl.constexpr, SP2: tl.constexpr, SP3: tl.constexpr,
              BN1: tl.constexpr, BN2: tl.constexpr, BN3: tl.constexpr,
              BM: tl.constexpr, BK: tl.constexpr, SPIN: tl.constexpr):  # fmt: skip
    """A decode layer after its attention: ``x += attn Woᵀ``; ``s = silu(g r)·(u r)`` with ``[g |
    u] = x Wguᵀ`` and ``r = 1 / rms(x)``; ``x += s Wdᵀ``; two barriers. ``sync_ptr``: [arrivals,
    error flag, exits]; the last program out resets the counts, so the next launch needs no memset."""
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    c2 = count_ptr + tl.cdiv(hidden, BN1)  # each projection's tile counters
    c3 = c2 + tl.cdiv(inter, BN2)
    phase(attn_ptr, q_width, wo_ptr, x_ptr, hidden, part_ptr, count_ptr, M, hidden, q_width, KP1,
          pid, n_prog, 1, SP1, BM, BN1, BK)  # fmt: skip
    grid_sync(sync_ptr, sync_ptr + 1, n_prog, SPIN)
    phase(x_ptr, hidden, wgu_ptr, s_ptr, inter, part_ptr, c2, M, inter, hidden, KP2,
          pid, n_prog, 2, SP2, BM, BN2, BK, ssq_ptr, eps, True)  # fmt: skip
    grid_sync(sync_ptr, sync_ptr + 1, 2 * n_prog, SPIN)
    phase(s_ptr, inter, wd_ptr, x_ptr, hidden, part_ptr, c3, M, hidden, inter, KP3,
          pid, n_prog, 1, SP3, BM, BN3, BK)  # fmt: skip
    # every program counted here has passed the second barrier: none polls it any more
    if tl.atomic_add(sync_ptr + 2, 1, sem="acq_rel", scope="gpu") == n_prog - 1:
        tl.store(sync_ptr, 0)
        tl.store(sync_ptr + 2, 0)
