"""Triton kernels (imported lazily: only when a Triton backend runs, so CPU-only installs without
Triton import `megalith.kernels` fine). Fixed launch configurations chosen per shape by small
heuristics: the interpreter cannot autotune, and memory-bound kernels need no search.

Every kernel computes in fp32 and stores in the output's dtype.
"""

# Triton kernels take every pointer, stride and size as a separate argument.
# ruff: noqa: PLR0913
# mypy: disable-error-code="no-untyped-def"

from __future__ import annotations

import triton
import triton.language as tl


def block_for(n: int, cap: int = 65536) -> int:
    return min(cap, triton.next_power_of_2(max(1, n)))


def warps_for(block: int) -> int:
    return 4 if block <= 2048 else 8 if block <= 8192 else 16


# -- RMSNorm ---------------------------------------------------------------------------------------
@triton.jit
def rms_fwd_kernel(X, W, Y, RSTD, stride_x, stride_y, M, N, eps, BLOCK_M: tl.constexpr, BLOCK: tl.constexpr):
    """A [BLOCK_M, N] tile of rows per program: y = x·rstd·w, rstd = 1/√(mean(x²) + eps)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK)
    rmask = rows < M
    mask = rmask[:, None] & (cols < N)[None, :]
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / N + eps)
    w = tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32)
    y = x * rstd[:, None] * w[None, :]
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + rows, rstd, mask=rmask)


@triton.jit
def rms_bwd_kernel(
    DY, X, W, RSTD, DX, DWP, stride_dy, stride_x, stride_dx, M, N, tiles_per_prog,
    BLOCK_M: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """dx = rstd·(w⊙dy − x̂·mean(x̂⊙w⊙dy)); partial dw = Σ_rows dy⊙x̂ over this program's tiles."""
    pid = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    cmask = cols < N
    w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    for t in range(0, tiles_per_prog):
        rows = (pid * tiles_per_prog + t) * BLOCK_M + tl.arange(0, BLOCK_M)
        rmask = rows < M
        mask = rmask[:, None] & cmask[None, :]
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=rmask, other=0.0)
        xh = x * rstd[:, None]
        wdy = dy * w[None, :]
        c = tl.sum(xh * wdy, axis=1) / N
        dx = (wdy - xh * c[:, None]) * rstd[:, None]
        tl.store(DX + rows[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        dw += tl.sum(dy * xh, axis=0)
    tl.store(DWP + pid * N + cols, dw, mask=cmask)


# -- rotary embedding ------------------------------------------------------------------------------
@triton.jit
def rope_kernel(
    X, COS, SIN, Y, S, H,
    sxb, sxh, sxs, sxd, syb, syh, sys, syd, scb, scs, scd,
    HALF: tl.constexpr, BS: tl.constexpr, HP: tl.constexpr, DP: tl.constexpr, BACKWARD: tl.constexpr,
):  # fmt: skip
    """y = x·cos + rotate_half(x)·sin, rotate_half(x) = [−x₂, x₁] (HF Llama). Backward applies the
    transpose: dx₁ = dy₁·cos₁ + dy₂·sin₂, dx₂ = dy₂·cos₂ − dy₁·sin₁. One program per (batch, block
    of BS positions), all heads: a [BS, H, D/2] tile per half."""
    nblocks = tl.cdiv(S, BS)
    pid = tl.program_id(0)
    b = (pid // nblocks).to(tl.int64)
    s = (pid % nblocks).to(tl.int64) * BS + tl.arange(0, BS)[:, None, None]
    h = tl.arange(0, HP)[None, :, None]
    d = tl.arange(0, DP)[None, None, :]
    cmask = (s < S) & (d < HALF)
    mask = cmask & (h < H)
    cbase = b * scb + s * scs
    c1 = tl.load(COS + cbase + d * scd, mask=cmask, other=0.0).to(tl.float32)
    c2 = tl.load(COS + cbase + (d + HALF) * scd, mask=cmask, other=0.0).to(tl.float32)
    s1 = tl.load(SIN + cbase + d * scd, mask=cmask, other=0.0).to(tl.float32)
    s2 = tl.load(SIN + cbase + (d + HALF) * scd, mask=cmask, other=0.0).to(tl.float32)
    xbase = X + b * sxb + s * sxs + h * sxh
    x1 = tl.load(xbase + d * sxd, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(xbase + (d + HALF) * sxd, mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:
        y1 = x1 * c1 + x2 * s2
        y2 = x2 * c2 - x1 * s1
    else:
        y1 = x1 * c1 - x2 * s1
        y2 = x2 * c2 + x1 * s2
    ybase = Y + b * syb + s * sys + h * syh
    tl.store(ybase + d * syd, y1.to(Y.dtype.element_ty), mask=mask)
    tl.store(ybase + (d + HALF) * syd, y2.to(Y.dtype.element_ty), mask=mask)


# -- SwiGLU ----------------------------------------------------------------------------------------
@triton.jit
def swiglu_fwd_kernel(G, U, Y, sg, su, sy, N, BLOCK: tl.constexpr):
    """y = silu(g)·u = g·σ(g)·u, row-strided 2-D views."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    g = tl.load(G + row * sg + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + row * su + cols, mask=mask, other=0.0).to(tl.float32)
    y = g * tl.sigmoid(g) * u
    tl.store(Y + row * sy + cols, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def swiglu_bwd_kernel(
    DY, G, U, DG, DU, H, sdy, sg, su, sdg, sdu, sh, N, BLOCK: tl.constexpr, STORE_H: tl.constexpr
):  # fmt: skip
    """du = dy·silu(g); dg = dy·u·σ(g)·(1 + g·(1 − σ(g))); with STORE_H also h = silu(g)·u (the
    forward's output, rebuilt from the values already loaded instead of by a second kernel)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    dy = tl.load(DY + row * sdy + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + row * sg + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + row * su + cols, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    tl.store(DU + row * sdu + cols, (dy * g * sig).to(DU.dtype.element_ty), mask=mask)
    if STORE_H:
        tl.store(H + row * sh + cols, (g * sig * u).to(H.dtype.element_ty), mask=mask)
    dg = dy * u * sig * (1.0 + g * (1.0 - sig))
    tl.store(DG + row * sdg + cols, dg.to(DG.dtype.element_ty), mask=mask)


# -- cross-entropy rows (in place: logits -> gradient) ---------------------------------------------
@triton.jit
def ce_rows_kernel(L, LABELS, LOSS, SCALE, stride_l, V, ignore_index, BLOCK: tl.constexpr):
    """Per row: loss = (logsumexp(z) − z[label])·scale; z is overwritten with
    (softmax(z) − onehot(label))·scale (zeros for ignored rows). Online max/sum over vocab blocks."""
    row = tl.program_id(0).to(tl.int64)
    base = L + row * stride_l
    label = tl.load(LABELS + row)
    scale = tl.load(SCALE).to(tl.float32)
    m = float("-inf")
    acc = 0.0
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        z = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        new_m = tl.maximum(m, tl.max(z, axis=0))
        acc = acc * tl.exp(m - new_m) + tl.sum(tl.exp(z - new_m), axis=0)
        m = new_m
    lse = m + tl.log(acc)
    valid = label != ignore_index
    safe = tl.where(valid, label, 0)
    z_label = tl.load(base + safe).to(tl.float32)
    tl.store(LOSS + row, tl.where(valid, (lse - z_label) * scale, 0.0))
    coef = tl.where(valid, scale, 0.0)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        z = tl.load(base + cols, mask=cols < V, other=0.0).to(tl.float32)
        grad = (tl.exp(z - lse) - tl.where(cols == safe, 1.0, 0.0)) * coef
        tl.store(base + cols, grad.to(L.dtype.element_ty), mask=cols < V)


# -- AdamW -----------------------------------------------------------------------------------------
@triton.jit
def _adamw_block(P, G, M, V, offs, mask, lr, beta1, beta2, eps, weight_decay, step_size, bc2_sqrt):
    """Decoupled weight decay (Loshchilov & Hutter): p ← p(1 − lr·wd); m ← β₁m + (1−β₁)g;
    v ← β₂v + (1−β₂)g²; p ← p − (lr/bc₁)·m / (√v/√bc₂ + ε), on elements `offs` of one tensor."""
    p = tl.load(P + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    m = tl.load(M + offs, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(V + offs, mask=mask, other=0.0).to(tl.float32)
    p = p * (1.0 - lr * weight_decay)
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    p = p - step_size * m / (tl.sqrt(v) / bc2_sqrt + eps)
    tl.store(P + offs, p.to(P.dtype.element_ty), mask=mask)
    tl.store(M + offs, m.to(M.dtype.element_ty), mask=mask)
    tl.store(V + offs, v.to(V.dtype.element_ty), mask=mask)


@triton.jit
def adamw_kernel(
    P, G, M, V, n, lr, beta1, beta2, eps, weight_decay, step_size, bc2_sqrt, BLOCK: tl.constexpr,
    STEP=None, LR=None, CAPTURED: tl.constexpr = False,
):  # fmt: skip
    """`_adamw_block` over one tensor, a block per program; `CAPTURED`: lr and the bias
    corrections from the device (`_captured_hyper`) instead of the scalar arguments."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    if CAPTURED:
        lr, step_size, bc2_sqrt = _captured_hyper(STEP, LR, beta1, beta2)
    _adamw_block(P, G, M, V, offs, offs < n, lr, beta1, beta2, eps, weight_decay, step_size, bc2_sqrt)


@triton.jit
def _captured_hyper(STEP, LR, beta1, beta2):
    """(lr, lr / (1 − β₁ᵗ), √(1 − β₂ᵗ)) with the step t and lr read from device memory, so that a
    launch recorded in a CUDA graph uses the values of each replay (fp32, as torch's capturable
    AdamW computes them)."""
    t = tl.load(STEP).to(tl.float32)
    lr = tl.load(LR).to(tl.float32)
    bc1 = 1.0 - tl.exp2(t * tl.log2(beta1))
    bc2 = 1.0 - tl.exp2(t * tl.log2(beta2))
    return lr, lr / bc1, tl.sqrt(bc2)


@triton.jit
def adamw_multi_kernel(
    ADDRS, BLOCK_TENSOR, BLOCK_START, NUMELS, lr, beta1, beta2, eps, weight_decay, step_size, bc2_sqrt,
    P_TY: tl.constexpr, S_TY: tl.constexpr, BLOCK: tl.constexpr, LR=None, CAPTURED: tl.constexpr = False,
):  # fmt: skip
    """`_adamw_block` over many tensors in one launch: program i updates block BLOCK_START[i] of
    tensor BLOCK_TENSOR[i], whose p, g, m, v addresses are row t of ADDRS [T, 4] (p, g of dtype
    P_TY; m, v of S_TY). The caller guarantees 16-byte aligned addresses and numels divisible by
    16; the hints say so, without them the compiler cannot vectorise (16-bit scalar accesses).
    `CAPTURED`: rows of 5, the fifth the address of the tensor's float32 step count, and lr read
    from `LR` (`_captured_hyper`)."""
    pid = tl.program_id(0)
    t = tl.load(BLOCK_TENSOR + pid).to(tl.int64)
    n = tl.multiple_of(tl.load(NUMELS + t), 16)
    offs = tl.multiple_of(tl.load(BLOCK_START + pid), BLOCK) + tl.arange(0, BLOCK)
    row = ADDRS + (5 if CAPTURED else 4) * t
    P = tl.multiple_of(tl.load(row).to(tl.pointer_type(P_TY)), 16)
    G = tl.multiple_of(tl.load(row + 1).to(tl.pointer_type(P_TY)), 16)
    M = tl.multiple_of(tl.load(row + 2).to(tl.pointer_type(S_TY)), 16)
    V = tl.multiple_of(tl.load(row + 3).to(tl.pointer_type(S_TY)), 16)
    if CAPTURED:
        lr, step_size, bc2_sqrt = _captured_hyper(
            tl.load(row + 4).to(tl.pointer_type(tl.float32)), LR, beta1, beta2
        )
    _adamw_block(P, G, M, V, offs, offs < n, lr, beta1, beta2, eps, weight_decay, step_size, bc2_sqrt)
