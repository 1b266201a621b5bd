"""The decode step's sampling and bookkeeping as two Triton kernels (unfiltered sampling, CUDA).

Sampling by the Gumbel-max trick: ``argmax_i z_i + g_i`` with ``z = logits / T`` and i.i.d.
``g_i = -log(-log u_i)``, ``u_i ~ U(0, 1)``, is distributed as ``Categorical(softmax(z))`` (the
exponential race of :mod:`.sampling` in log space: ``g = -log E`` with ``E ~ Exp(1)``). The
uniforms come from Philox inside the kernel (four per call), keyed by ``seed + ridx`` (the call's
seed, drawn from its generator, plus the output column) and counted by position in the row's
chunks: no noise tensor is written or read, and runs with the same generator state draw the same
tokens.

* ``chunk`` (grid ``b x C``, ``C = V / BLOCK``): per vocabulary chunk the online-softmax partials
  ``m = max z``, ``l = sum exp(z - m)``, the best ``z + g`` and its index, and the largest raw
  logit and its index (greedy rows; first index on ties, as ``argmax``);
* ``finish`` (grid ``b``): combines the chunks, takes the greedy or the sampled token, its log-prob
  ``z_y - M - log L`` (the module convention of :mod:`.sampling`: temperature-scaled, untruncated),
  then does the step's bookkeeping: finished rows get ``pad`` and log-prob 0, a row that samples one
  of the ``eos`` ids is finished, and the token and log-prob are recorded at column ``ridx``.

Top-k / top-p need a sort and stay on the torch path (:func:`.sampling.sample_tokens`).
:func:`sample_step` is the entry point; kernels are built lazily (``TRITON_INTERPRET=1`` then runs
them on the CPU, which is how the tests check them).
"""

# ruff: noqa: PLR0913  (Triton kernels take their pointers, strides and sizes as arguments)
from __future__ import annotations

from functools import cache
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from megalith_chat.engine.fast_state import DecodeState

BLOCK = 2048  # vocabulary entries per chunk program (a multiple of 4)


def make_kernels(block: int = BLOCK) -> tuple[Any, Any, int]:
    """Fresh ``(chunk, finish, block)`` Triton kernels (reads ``TRITON_INTERPRET`` now)."""
    import triton
    import triton.language as tl

    # arguments stay unannotated: @triton.jit reads annotations (tl.constexpr) to specialise a kernel
    @triton.jit
    def chunk(logits_ptr, inv_t_ptr, seed_ptr, ridx_ptr, pf_ptr, pi_ptr, s_logits, vocab, num_chunks,  # type: ignore[no-untyped-def]
              BLOCK: tl.constexpr):  # fmt: skip
        r = tl.program_id(0)
        c = tl.program_id(1)
        # the chunk as 4 quarters [4, Q], so that one Philox call gives the 4 uniforms of a column
        quarter = tl.arange(0, 4)[:, None]
        j = tl.arange(0, BLOCK // 4)[None, :]
        i = c * BLOCK + quarter * (BLOCK // 4) + j
        live = i < vocab
        raw = tl.load(logits_ptr + r.to(tl.int64) * s_logits + i, mask=live, other=float("-inf"))
        raw = tl.reshape(raw.to(tl.float32), [BLOCK])
        z = raw * tl.load(inv_t_ptr + r)
        m = tl.max(z, axis=0)
        lsum = tl.sum(tl.exp(z - m), axis=0)
        seed = tl.load(seed_ptr) + tl.load(ridx_ptr)
        u0, u1, u2, u3 = tl.rand4x(seed, (r * num_chunks + c) * (BLOCK // 4) + j)
        u = tl.where(quarter == 0, u0, tl.where(quarter == 1, u1, tl.where(quarter == 2, u2, u3)))
        u = tl.reshape(tl.maximum(u, 1e-30), [BLOCK])
        score = tl.where(tl.reshape(live, [BLOCK]), z - tl.log(-tl.log(u)), float("-inf"))
        part = (r * num_chunks + c).to(tl.int64)
        tl.store(pf_ptr + part * 4 + 0, m)
        tl.store(pf_ptr + part * 4 + 1, lsum)
        tl.store(pf_ptr + part * 4 + 2, tl.max(score, axis=0))
        tl.store(pf_ptr + part * 4 + 3, tl.max(raw, axis=0))
        tl.store(pi_ptr + part * 2 + 0, c * BLOCK + tl.argmax(score, axis=0))
        tl.store(pi_ptr + part * 2 + 1, c * BLOCK + tl.argmax(raw, axis=0))

    @triton.jit
    def finish(pf_ptr, pi_ptr, logits_ptr, inv_t_ptr, greedy_ptr, done_ptr, eos_ptr, pad_ptr, ridx_ptr,  # type: ignore[no-untyped-def]
               tok_ptr, out_tok_ptr, out_lp_ptr, s_logits, s_out, num_chunks,
               BC: tl.constexpr, NE: tl.constexpr):  # fmt: skip
        r = tl.program_id(0).to(tl.int64)
        c = tl.arange(0, BC)
        live = c < num_chunks
        part = r * num_chunks + c
        m = tl.load(pf_ptr + part * 4 + 0, mask=live, other=float("-inf"))
        lsum = tl.load(pf_ptr + part * 4 + 1, mask=live, other=0.0)
        best = tl.load(pf_ptr + part * 4 + 2, mask=live, other=float("-inf"))
        top = tl.load(pf_ptr + part * 4 + 3, mask=live, other=float("-inf"))
        big = tl.max(m, axis=0)
        total = tl.sum(lsum * tl.exp(m - big), axis=0)
        sampled = tl.load(pi_ptr + (r * num_chunks + tl.argmax(best, axis=0)) * 2 + 0)
        greedy = tl.load(pi_ptr + (r * num_chunks + tl.argmax(top, axis=0)) * 2 + 1)
        tok = tl.where(tl.load(greedy_ptr + r) != 0, greedy, sampled).to(tl.int64)
        z = tl.load(logits_ptr + r * s_logits + tok).to(tl.float32) * tl.load(inv_t_ptr + r)
        lp = z - big - tl.log(total)
        done = tl.load(done_ptr + r) != 0
        tok = tl.where(done, tl.load(pad_ptr), tok)
        lp = tl.where(done, 0.0, lp)
        hit = tl.sum((tl.load(eos_ptr + tl.arange(0, NE)) == tok).to(tl.int32), axis=0) > 0
        tl.store(done_ptr + r, (done | hit).to(done_ptr.dtype.element_ty))
        col = tl.load(ridx_ptr)
        tl.store(out_tok_ptr + r * s_out + col, tok)
        tl.store(out_lp_ptr + r * s_out + col, lp)
        tl.store(tok_ptr + r, tok)

    return chunk, finish, block


@cache
def _kernels() -> tuple[Any, Any, int]:
    return make_kernels()


def sample_step(
    logits: torch.Tensor, st: DecodeState, b: int, kernels: tuple[Any, Any, int] | None = None
) -> None:
    """Sample rows ``0..b-1`` of ``logits [b, V]`` (unit stride) with ``st``'s parameters and record
    them (see the module doc); ``st.slot`` and ``st.ridx`` are left for the caller to advance."""
    chunk, finish, block = kernels or _kernels()
    vocab = logits.shape[1]
    chunks = -(-vocab // block)
    if b * chunks * block // 4 >= 2**31:
        raise ValueError(
            f"fused sampling counts Philox offsets in int32: {b} rows x {vocab} tokens is too many"
        )
    pf = torch.empty(b, chunks, 4, device=logits.device, dtype=torch.float32)
    pi = torch.empty(b, chunks, 2, device=logits.device, dtype=torch.int32)
    chunk[(b, chunks)](
        logits, st.inv_t, st.seed, st.ridx, pf, pi, logits.stride(0), vocab, chunks, BLOCK=block, num_warps=4
    )
    finish[(b,)](
        pf, pi, logits, st.inv_t, st.greedy, st.done, st.eos, st.pad, st.ridx, st.tok, st.out_tok, st.out_lp,
        logits.stride(0), st.out_tok.stride(0), chunks, BC=max(2, 1 << (chunks - 1).bit_length()),
        NE=st.eos.shape[0],
    )  # fmt: skip
