"""The persistent Triton kernels of :mod:`.fast_chain` (imported lazily, when one first runs:
``TRITON_INTERPRET`` is read at import). The prefetch helpers use inline PTX, so they compile
for CUDA only; the interpreter runs the kernels with them off."""

# Triton kernels take every pointer, stride and size as a separate argument.
# ruff: noqa: PLR0913
# mypy: disable-error-code="no-untyped-def"

from __future__ import annotations

import triton
import triton.language as tl

from megalith_chat.engine._tile_gemm import gemm_tasks


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
    for layer in range(layers):
        if IDLE:
            tasks0 = tl.cdiv(3 * hidden, BN0) * SP0
            prefetch_idle(wo, hidden * hidden, tasks0, pid, n_prog)
            prefetch_idle(wgu, 2 * inter * hidden, tasks0, pid, n_prog)
        prefetch_ahead(0, PREFETCH, layer, layers, wq, wo, wgu, wd, hidden, inter, KP0, KP1, KP2, KP3,
                       pid, n_prog, SP0, SP1, SP2, SP3, BN0, BN1, BN2, BN3)  # fmt: skip
        gemm_tasks(x_ptr, hidden, wq, hidden, t_ptr, 3 * hidden, part_ptr, count_ptr, M, 3 * hidden, hidden, KP0,
                   pid, n_prog, 0, SP0, BM, BN0, BK)  # fmt: skip
        grid_sync(bar_ptr, err_ptr, (4 * layer + 1) * n_prog, SPIN)  # arrivals so far, whole launch
        prefetch_ahead(1, PREFETCH, layer, layers, wq, wo, wgu, wd, hidden, inter, KP0, KP1, KP2, KP3,
                       pid, n_prog, SP0, SP1, SP2, SP3, BN0, BN1, BN2, BN3)  # fmt: skip
        gemm_tasks(t_ptr, 3 * hidden, wo, hidden, x_ptr, hidden, part_ptr, c1, M, hidden, hidden, KP1,
                   pid, n_prog, 1, SP1, BM, BN1, BK)  # fmt: skip
        grid_sync(bar_ptr, err_ptr, (4 * layer + 2) * n_prog, SPIN)
        if IDLE:
            tasks2 = tl.cdiv(inter, BN2) * SP2
            prefetch_idle(wd, hidden * inter, tasks2, pid, n_prog)
            if layer + 1 < layers:
                prefetch_idle(wq + 3 * hidden * hidden, 3 * hidden * hidden, tasks2, pid, n_prog)
        prefetch_ahead(2, PREFETCH, layer, layers, wq, wo, wgu, wd, hidden, inter, KP0, KP1, KP2, KP3,
                       pid, n_prog, SP0, SP1, SP2, SP3, BN0, BN1, BN2, BN3)  # fmt: skip
        gemm_tasks(x_ptr, hidden, wgu, hidden, s_ptr, inter, part_ptr, c2, M, inter, hidden, KP2,
                   pid, n_prog, 2, SP2, BM, BN2, BK)  # fmt: skip
        grid_sync(bar_ptr, err_ptr, (4 * layer + 3) * n_prog, SPIN)
        prefetch_ahead(3, PREFETCH, layer, layers, wq, wo, wgu, wd, hidden, inter, KP0, KP1, KP2, KP3,
                       pid, n_prog, SP0, SP1, SP2, SP3, BN0, BN1, BN2, BN3)  # fmt: skip
        gemm_tasks(s_ptr, inter, wd, inter, x_ptr, hidden, part_ptr, c3, M, hidden, inter, KP3,
                   pid, n_prog, 1, SP3, BM, BN3, BK)  # fmt: skip
        grid_sync(bar_ptr, err_ptr, (4 * layer + 4) * n_prog, SPIN)
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
    gemm_tasks(attn_ptr, q_width, wo_ptr, q_width, x_ptr, hidden, part_ptr, count_ptr, M, hidden, q_width, KP1,
               pid, n_prog, 1, SP1, BM, BN1, BK)  # fmt: skip
    grid_sync(sync_ptr, sync_ptr + 1, n_prog, SPIN)
    gemm_tasks(x_ptr, hidden, wgu_ptr, hidden, s_ptr, inter, part_ptr, c2, M, inter, hidden, KP2,
               pid, n_prog, 2, SP2, BM, BN2, BK, ssq_ptr, eps, True)  # fmt: skip
    grid_sync(sync_ptr, sync_ptr + 1, 2 * n_prog, SPIN)
    gemm_tasks(s_ptr, inter, wd_ptr, inter, x_ptr, hidden, part_ptr, c3, M, hidden, inter, KP3,
               pid, n_prog, 1, SP3, BM, BN3, BK)  # fmt: skip
    # every program counted here has passed the second barrier: none polls it any more
    if tl.atomic_add(sync_ptr + 2, 1, sem="acq_rel", scope="gpu") == n_prog - 1:
        tl.store(sync_ptr, 0)
        tl.store(sync_ptr + 2, 0)
