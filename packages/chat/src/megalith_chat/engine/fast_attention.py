"""Split-KV decode attention in Triton ("flash-decoding", Dao et al. 2023) for the fast engine.

One query token per row attends to its cache slots ``start[r] <= j <= slot`` among the first
``Lb`` slots of ``k, v : [b, KV, T, D]`` (a strided view of the static cache). The ``G = H / KV``
query heads of a key/value head are processed together (``q : [b, KV, G, D]``), so each key is
read once per group. Pass 1 (grid ``b*KV x S``) computes, per split ``s`` of the key range, the
online-softmax partials ``m_s = max_j z_j``, ``l_s = sum_j exp(z_j - m_s)``,
``a_s = sum_j exp(z_j - m_s) v_j`` with ``z_j = scale * q.k_j`` (float32); pass 2 combines them:
``out = sum_s e^{m_s - M} a_s / sum_s e^{m_s - M} l_s``, ``M = max_s m_s`` (with one split, pass 1
writes ``a / l`` itself and pass 2 is skipped). The G query rows are padded to 16 so that q.kᵀ and
p.v run as tensor-core dots (the elementwise-product-and-reduce form compiled to ~400 warp
shuffles and ~35 barriers per key block); the loop visits only the blocks that hold valid slots
(``start`` to ``slot``), not the whole static cache.

Given a :class:`Prologue` instead of ``q`` (the unshared path), each program also does the
prologue's work for its row and key/value head: scales its slice of the QKV projection by the
row's ``1 / rms(x)``, adds the bias, rotates its query heads and the step's key (RoPE), writes the
key and value into the cache slot ``slot`` and attends to that slot from registers (the loop reads
slots ``start .. slot - 1``), which saves a launch per layer.

Rows that are samples of one prompt (GRPO's group of ``R`` rows, identical in slots ``start`` to
``prompt_end - 1``) can share those slots: pass 1 then runs twice. First over the prompt (``PART=1``,
grid ``groups*KV x S'``), with the group's ``R*G`` query rows against its first row's prompt slots,
so they are read once for the group, writing each row's partials; then over each row's own slots
from ``prompt_end`` on (``PART=2``, one split: they are at most the new tokens), which merges the
prompt's partials into its own and writes the output (no combine pass).

Kernels are built lazily by :func:`make_kernels` (``TRITON_INTERPRET=1`` then runs them on the
CPU, which is how the tests check them); :func:`decode_attention` is the entry point.
"""

# ruff: noqa: PLR0913  (Triton kernels take their pointers, strides and sizes as arguments)
from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import cache
from typing import Any

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

TARGET_PROGRAMS = 512  # programs a decode-attention launch aims for (key-range splits make up the rest)
BLOCK_N = 32  # keys per loop step; with LAUNCH the fastest of a sweep on the H200 (see decode_attention)
LAUNCH = {"num_warps": 2, "num_stages": 3}


def make_kernels() -> tuple[Any, Any]:  # noqa: PLR0915, C901  (the kernels' bodies)
    """Fresh ``(partial, combine)`` Triton kernels (reads ``TRITON_INTERPRET`` now)."""
    import triton
    import triton.language as tl

    # arguments stay unannotated: @triton.jit reads annotations (tl.constexpr) to specialise a kernel
    @triton.jit
    def partial(q_ptr, k_ptr, v_ptr, start_ptr, slot_ptr, m_ptr, l_ptr, a_ptr,  # type: ignore[no-untyped-def]  # noqa: PLR0915
                sk_b, sk_h, sk_t, kv_heads, kv_len, split_len, num_splits, scale,
                o_ptr, pend_ptr, split_offset,
                qkv_ptr, x_ptr, bias_ptr, cos_ptr, sin_ptr, s_qkv, s_x, s_cos, s_sin, hidden, eps,
                G: tl.constexpr, BG: tl.constexpr, D: tl.constexpr,
                BN: tl.constexpr, PREC: tl.constexpr, DIRECT: tl.constexpr, PART: tl.constexpr,
                R: tl.constexpr, BQ: tl.constexpr, ROPE: tl.constexpr, NORM: tl.constexpr,
                HAS_BIAS: tl.constexpr, HIDDEN: tl.constexpr):  # fmt: skip
        # program (R rows x key/value head, split) over PART of the slots: 0 each row's own from
        # start to slot; 1 the prompt slots start .. prompt_end - 1 that a group of R rows shares,
        # read once from its first row; 2 each row's own from prompt_end on
        gh = tl.program_id(0)
        sp = tl.program_id(1)
        lead = (gh // kv_heads) * R
        h = gh % kv_heads
        first = tl.load(start_ptr + lead)
        if PART == 2:
            first = tl.maximum(first, tl.load(pend_ptr))
        last = tl.load(pend_ptr) - 1 if PART == 1 else tl.load(slot_ptr)
        qi = tl.arange(0, BQ)
        d = tl.arange(0, D)
        live = qi < R * G
        if R == 1:  # the G query rows padded to BQ >= 16 rows: both products run as tensor-core dots
            j = qi
            owner = gh  # (row, head) whose partials these are
        else:  # query row qi: head qi % G of member qi // G
            j = qi % G
            owner = (lead + qi // G) * kv_heads + h
        src = owner * G + j
        m_i = tl.full([BQ], -1e30, tl.float32)
        l_i = tl.zeros([BQ], tl.float32)
        acc = tl.zeros([BQ, D], tl.float32)
        base = lead * sk_b + h * sk_h
        lo = sp * split_len
        if ROPE:  # q, k, v of this step from the QKV projection (the prologue, done here; PART 0)
            heads = kv_heads * G
            half = D // 2
            partner = (d + half) % D  # rotate_half([a, b]) = [-b, a]
            sign = tl.where(d < half, -1.0, 1.0)
            cs = tl.load(cos_ptr + lead * s_cos + d).to(tl.float32)
            sn = tl.load(sin_ptr + lead * s_sin + d).to(tl.float32) * sign
            row = qkv_ptr + lead * s_qkv
            qh = h * G + j  # query head of each query row
            qa = tl.load(row + qh[:, None] * D + d[None, :], mask=live[:, None], other=0.0).to(tl.float32)
            qb = tl.load(row + qh[:, None] * D + partner[None, :], mask=live[:, None], other=0.0).to(
                tl.float32
            )
            kh = (heads + h) * D
            vh = (heads + kv_heads + h) * D
            ka = tl.load(row + kh + d).to(tl.float32)
            kb = tl.load(row + kh + partner).to(tl.float32)
            vn = tl.load(row + vh + d).to(tl.float32)
            if NORM:  # 1 / rms of the row's residual stream (its norm weight is folded into W_qkv)
                e = tl.arange(0, HIDDEN)
                xr = tl.load(x_ptr + lead * s_x + e, mask=e < hidden, other=0.0).to(tl.float32)
                inv = 1.0 / tl.sqrt(tl.sum(xr * xr, axis=0) / hidden + eps)
                qa, qb, ka, kb, vn = qa * inv, qb * inv, ka * inv, kb * inv, vn * inv
            if HAS_BIAS:
                qa += tl.load(bias_ptr + qh[:, None] * D + d[None, :], mask=live[:, None], other=0.0).to(
                    tl.float32
                )
                qb += tl.load(
                    bias_ptr + qh[:, None] * D + partner[None, :], mask=live[:, None], other=0.0
                ).to(tl.float32)
                ka += tl.load(bias_ptr + kh + d).to(tl.float32)
                kb += tl.load(bias_ptr + kh + partner).to(tl.float32)
                vn += tl.load(bias_ptr + vh + d).to(tl.float32)
            q = (qa * cs[None, :] + qb * sn[None, :]).to(k_ptr.dtype.element_ty)
            kn = (ka * cs + kb * sn).to(k_ptr.dtype.element_ty)
            vn = vn.to(v_ptr.dtype.element_ty)
            last = last - 1  # the current slot is added from registers below, not read back
        else:
            q = tl.load(q_ptr + src[:, None] * D + d[None, :], mask=live[:, None], other=0.0)
        hi = tl.minimum(tl.minimum(lo + split_len, kv_len), last + 1)
        for n0 in range(tl.maximum(lo, first // BN * BN), hi, BN):  # valid slots only
            n = n0 + tl.arange(0, BN)
            ok = (n >= first) & (n < hi)
            offs = base + n[:, None] * sk_t + d[None, :]
            k = tl.load(k_ptr + offs, mask=ok[:, None], other=0.0)
            v = tl.load(v_ptr + offs, mask=ok[:, None], other=0.0)
            z = tl.where(ok[None, :], tl.dot(q, tl.trans(k), input_precision=PREC) * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(z, axis=1))
            p = tl.exp(z - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
            m_i = m_new
        if ROPE:
            slot = last + 1
            if sp == 0:  # the first split adds the current slot (the combine merges any split's)
                tl.store(k_ptr + base + slot * sk_t + d, kn)
                tl.store(v_ptr + base + slot * sk_t + d, vn)
                z = tl.sum(q.to(tl.float32) * kn.to(tl.float32)[None, :], axis=1) * scale
                m_new = tl.maximum(m_i, z)
                p = tl.exp(z - m_new)
                alpha = tl.exp(m_i - m_new)
                l_i = l_i * alpha + p
                acc = acc * alpha[:, None] + p[:, None] * vn.to(tl.float32)[None, :]
                m_i = m_new
        if DIRECT:  # one split: the partial is the answer (no combine pass)
            if PART == 2:  # merge the group's prompt partials, entries 0 .. split_offset - 1
                for s in range(0, split_offset):
                    prow = (owner * num_splits + s) * BG + j
                    m_s = tl.load(m_ptr + prow, mask=live, other=-1e30)
                    l_s = tl.load(l_ptr + prow, mask=live, other=0.0)
                    a_s = tl.load(a_ptr + prow[:, None] * D + d[None, :], mask=live[:, None], other=0.0)
                    m_new = tl.maximum(m_i, m_s)
                    alpha = tl.exp(m_i - m_new)
                    beta = tl.exp(m_s - m_new)
                    l_i = l_i * alpha + l_s * beta
                    acc = acc * alpha[:, None] + a_s * beta[:, None]
                    m_i = m_new
            out = acc / l_i[:, None]
            dst = o_ptr + src[:, None] * D + d[None, :]
            tl.store(dst, out.to(o_ptr.dtype.element_ty), mask=live[:, None])
        else:
            # the live rows only: with G = 1 (no GQA) the other BQ - 1 rows are padding, and writing
            # them multiplied the partials' bytes by 16
            row = (owner * num_splits + split_offset + sp) * BG + j  # combine reads BG rows a split
            tl.store(m_ptr + row, m_i, mask=live)
            tl.store(l_ptr + row, l_i, mask=live)
            tl.store(a_ptr + row[:, None] * D + d[None, :], acc, mask=live[:, None])

    @triton.jit
    def combine(m_ptr, l_ptr, a_ptr, o_ptr, num_splits,  # type: ignore[no-untyped-def]
                G: tl.constexpr, BG: tl.constexpr, D: tl.constexpr, BS: tl.constexpr):  # fmt: skip
        bh = tl.program_id(0)
        s = tl.arange(0, BS)
        g = tl.arange(0, BG)
        d = tl.arange(0, D)
        row = (bh * num_splits + s[:, None]) * BG + g[None, :]  # [BS, BG]
        live = (s[:, None] < num_splits) & (g[None, :] < G)
        m = tl.load(m_ptr + row, mask=live, other=-1e30)
        lsum = tl.load(l_ptr + row, mask=live, other=0.0)
        a = tl.load(a_ptr + row[:, :, None] * D + d[None, None, :], mask=live[:, :, None], other=0.0)
        top = tl.max(m, axis=0)
        w = tl.exp(m - top[None, :])
        den = tl.sum(w * lsum, axis=0)
        out = tl.sum(w[:, :, None] * a, axis=0) / den[:, None]
        tl.store(
            o_ptr + (bh * G + g[:, None]) * D + d[None, :],
            out.to(o_ptr.dtype.element_ty),
            mask=g[:, None] < G,
        )

    return partial, combine


@cache
def _kernels() -> tuple[Any, Any]:
    return make_kernels()


@dataclass(frozen=True)
class Prologue:
    """The decode step's QKV projection for :func:`decode_attention` to finish itself (the work of
    :func:`.fast_prologue.rope_store`): ``qkv [b, (H + 2 KV) D]``, ``cos, sin [b, D]`` (rows
    unit-stride); with ``x [b, hidden]`` scaled by ``1 / rms(x)``, then ``bias`` added."""

    qkv: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    x: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    eps: float = 0.0


def decode_attention(
    q: torch.Tensor | Prologue,
    k: torch.Tensor,
    v: torch.Tensor,
    start: torch.Tensor,
    slot: torch.Tensor,
    scale: float,
    kernels: tuple[Any, Any] | None = None,
    target_programs: int = TARGET_PROGRAMS,
    block_n: int = BLOCK_N,
    launch: dict[str, int] | None = None,
    members: int = 1,
    prompt_end: torch.Tensor | None = None,
) -> torch.Tensor:
    """``q [b, KV, G, D]`` (contiguous), ``k, v [b, KV, >=kv_len, D]`` (last dim contiguous, same
    strides), ``start [b]``, ``slot`` 0-d -> ``[b, KV, G, D]`` attention output (see module doc).

    ``q`` may instead be a :class:`Prologue`: each program then rotates its own query heads and
    writes the step's key and value into slot ``slot`` of ``k, v`` (which must be the cache's own
    views), one launch fewer per layer (not with ``members > 1``).

    ``target_programs``: split the key range until the grid has about this many programs;
    ``block_n``: keys per loop step; ``launch``: Triton launch options (``num_warps``, ``num_stages``).
    The defaults won a sweep on the H200 (block 32/64/128 x 2/4/8 warps x 1-3 stages x 1-2 splits,
    0.37B shape, 256 cached slots of which 201 valid, repeated calls, so partly L2-resident): at
    batch 64 14.6 µs per layer against 19.9 µs for 64-key blocks with 4 warps; at batch 256 56 vs
    58 µs. Inside the decode step: about 21 µs per layer (cuDNN's SDPA: 26). Swept again over 24
    layers of distinct caches (``benchmarks/gpu_decode_attention.py``, DRAM-resident as in the step):
    within 1 % of the best of 54 configurations at batch 64 (20.0 µs) and 2 % at batch 256 (66.5 µs).

    ``members > 1``: rows ``r·members .. (r+1)·members - 1`` are the samples of one prompt (GRPO's
    group), identical in cache slots ``start .. prompt_end - 1`` (0-d ``prompt_end``). Those slots
    are then read once per group, from its first row (``partial`` with ``PART=1``); a second
    ``partial`` reads each row's own slots from ``prompt_end`` on and merges the first one's partials
    (see module doc).
    """
    import triton

    partial, combine = kernels or _kernels()
    kv_len = k.shape[2]
    shared = members > 1
    pro = q if isinstance(q, Prologue) else None
    if pro is not None:
        if shared:
            raise ValueError("decode_attention: a Prologue cannot be finished by the shared-prompt path")
        b, dim, kv_heads = pro.qkv.shape[0], k.shape[3], k.shape[1]
        group = pro.qkv.shape[1] // dim // kv_heads - 2
        q = pro.qkv.new_empty(b, kv_heads, group, dim)  # no query buffer is read: a placeholder
    assert isinstance(q, torch.Tensor)
    b, kv_heads, group, dim = q.shape
    if shared and (prompt_end is None or b % members):
        raise ValueError(f"decode_attention: {b} rows do not form groups of {members} with a prompt_end")

    def layout(programs: int) -> tuple[int, int]:  # (splits, keys per split) of the kv_len slots
        splits = max(1, min(triton.cdiv(kv_len, block_n), triton.cdiv(target_programs, programs)))
        split_len = triton.cdiv(triton.cdiv(kv_len, splits), block_n) * block_n
        return triton.cdiv(kv_len, split_len), split_len

    bg = max(triton.next_power_of_2(group), 16)  # tl.dot needs 16 rows
    # shared: each row's own slots (at most the new tokens) in one split that also merges the
    # prompt's partials, so no combine pass
    splits, split_len = (1, triton.cdiv(kv_len, block_n) * block_n) if shared else layout(b * kv_heads)
    first_splits, first_len = layout(b // members * kv_heads) if shared else (0, 0)
    total = first_splits if shared else splits  # partial entries per (row, head)
    direct = shared or total == 1  # the last partial launch writes the output
    parts = b * kv_heads * total * bg if shared or total > 1 else 0
    m = torch.empty(parts, device=q.device, dtype=torch.float32)
    lsum = torch.empty_like(m)
    acc = torch.empty(parts, dim, device=q.device, dtype=torch.float32)
    out = torch.empty_like(q)
    sk = k.stride()
    end = prompt_end if prompt_end is not None else slot
    common = dict(G=group, BG=bg, D=dim, BN=block_n, PREC="ieee" if q.dtype == torch.float32 else "tf32",
                  **(LAUNCH if launch is None else launch))  # fmt: skip
    none = dict(ROPE=False, NORM=False, HAS_BIAS=False, HIDDEN=1)
    plain = (q, q, q, q, q, 0, 0, 0, 0, 1, 0.0)  # the Prologue arguments, unused
    if shared:  # the groups' prompt slots, into split entries 0 .. first_splits - 1
        partial[(b // members * kv_heads, first_splits)](
            q, k, v, start, slot, m, lsum, acc, sk[0], sk[1], sk[2], kv_heads, kv_len, first_len, total, scale,
            out, end, 0, *plain, DIRECT=False, PART=1, R=members,
            BQ=max(triton.next_power_of_2(members * group), 16), **none, **common,
        )  # fmt: skip
    if pro is None:
        rope, flags = plain, none
    else:
        x, bias = pro.x, pro.bias
        hidden = 1 if x is None else x.shape[1]
        rope = (pro.qkv, q if x is None else x, q if bias is None else bias, pro.cos, pro.sin,
                pro.qkv.stride(0), 0 if x is None else x.stride(0), pro.cos.stride(0), pro.sin.stride(0), hidden,
                pro.eps)  # fmt: skip
        flags = dict(
            ROPE=True, NORM=x is not None, HAS_BIAS=bias is not None, HIDDEN=triton.next_power_of_2(hidden)
        )
    partial[(b * kv_heads, splits)](
        q, k, v, start, slot, m, lsum, acc, sk[0], sk[1], sk[2], kv_heads, kv_len, split_len, total, scale,
        out, end, first_splits, *rope, DIRECT=direct, PART=2 if shared else 0, R=1, BQ=bg, **flags, **common,
    )  # fmt: skip
    if not direct:
        combine[(b * kv_heads,)](
            m, lsum, acc, out, total, G=group, BG=bg, D=dim, BS=max(triton.next_power_of_2(total), 2)
        )
    return out


def choose_attention(requested: str, device: torch.device, head_dim: int) -> str:
    """``"triton"`` if requested (or ``"auto"``) and it works here, else ``"sdpa"``.

    ``"auto"`` uses the kernel on CUDA when ``head_dim`` is a power of two and a self-check against
    SDPA on random data passes; an explicit ``"triton"`` that fails the check raises.
    """
    if requested == "sdpa" or (requested == "auto" and (device.type != "cuda" or head_dim & (head_dim - 1))):
        return "sdpa"
    error = _self_check(device, head_dim)
    if error is None:
        return "triton"
    if requested == "triton":
        from megalith.common.errors import ConfigError

        raise ConfigError(f"the Triton decode-attention kernel is unusable here: {error}")
    logger.warning("Triton decode attention unusable (%s); using SDPA", error)
    return "sdpa"


def shared_prompts_error(device: torch.device, head_dim: int) -> str | None:
    """None if the shared-prompt path (``members > 1``) passes its self-check here, else why not."""
    return _self_check(device, head_dim, members=2)


def _self_check(device: torch.device, head_dim: int, members: int = 1) -> str | None:
    """None if the kernel matches SDPA (fp32, 1e-4) on a small random problem, else why not.
    With ``members = 2`` the two rows share a prompt: the reference gives the second row the first
    row's prompt slots."""
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
    q, k, v = (torch.randn(2, 2, 2, s, head_dim, generator=gen)[0].to(device) for s in (2, 70, 70))
    start = torch.tensor([0, 9] if members == 1 else [9, 9], device=device)
    slot, end = torch.tensor(60, device=device), torch.tensor(30, device=device)
    try:
        out = decode_attention(q, k, v, start, slot, 0.125, members=members, prompt_end=end)
    except errors as exc:
        return repr(exc)
    if members > 1:
        k, v = k.clone(), v.clone()
        k[1, :, :30], v[1, :, :30] = k[0, :, :30], v[0, :, :30]
    ar = torch.arange(70, device=device)
    mask = ((ar >= start[:, None]) & (ar <= slot))[:, None, None]
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.125)
    err = float((out - ref).abs().max())
    return None if err < 1e-4 else f"max abs error {err:.2e} against SDPA"
