"""The decode step's decoder-layer pieces as fused Triton kernels for the fast engine.

At decode sizes (``T`` = batch rows, at most a few hundred) every projection streams its weight
once and the elementwise work is a few kilobytes, so the step's time goes to kernel count and
per-kernel latency, not to bytes. Per layer the torch path launches a QKV GEMM, the RoPE/cache
prologue, attention, the output GEMM, add + RMSNorm, the gate/up GEMM, SwiGLU, the down GEMM and
add + RMSNorm; here the prologue rides on the QKV projection and SwiGLU on the gate/up projection:

* :func:`qkv_rope` — ``[W_q; W_k; W_v] h`` (+ bias), RoPE on q and k, k and v written into cache
  slot ``slot``; program ``(j, tile)`` computes head ``j`` (query heads, then key, then value
  heads) as two half-head dots, so the rotate-half partner of every value is in registers;
* :func:`gate_up_silu` — ``silu(W_gate h) * (W_up h)`` from the fused ``[W_gate; W_up]``;
* :func:`linear` — ``W x`` (+ bias) for the output and down projections;
* :func:`add_rms_norm` — ``s = x + d`` and ``w * rmsnorm(s)``, one program per row.

The GEMMs put the weight rows on the dot's ``M`` side and the ``T`` tokens on its ``N`` side
("swap AB": ``T`` may be below the 16 rows a tensor-core dot needs), accumulate in float32 and
round where the unfused path rounds (each projection's output to the activation dtype, SwiGLU's
``silu(g)`` before the product, the residual sum before the norm). On Hopper every kernel is
launched with programmatic dependent launch (``pdl``): it may start while its predecessor drains
and waits (``gdc_wait``) before reading anything that predecessor wrote.

Kernels are built lazily by :func:`make_kernels` (``TRITON_INTERPRET=1`` then runs them on the
CPU, which is how the tests check them against :mod:`.fast_ops`).
"""

# ruff: noqa: PLR0913  (Triton kernels take their pointers, strides and sizes as arguments)
from __future__ import annotations

import logging
from functools import cache
from types import SimpleNamespace

import torch

logger = logging.getLogger(__name__)

BLOCK_K = 128  # reduction step of the projection kernels
LAUNCH = {"num_warps": 4, "num_stages": 4}


def make_kernels() -> SimpleNamespace:  # noqa: C901, PLR0915  (the kernels' bodies)
    """Fresh Triton kernels (reads ``TRITON_INTERPRET`` now)."""
    import triton
    import triton.language as tl

    try:
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    except ImportError:  # older Triton: kernels are only ever compiled with PDL=False
        gdc_launch_dependents = gdc_wait = None

    @triton.jit
    def qkv_rope(h_ptr, w_ptr, b_ptr, cos_ptr, sin_ptr, q_ptr, kc_ptr, vc_ptr, slot_ptr,
                 T, K, s_cos, s_sin, s_cb, s_ch, s_ct, heads, kv_heads,
                 HALF: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, HAS_BIAS: tl.constexpr,
                 PREC: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
        j = tl.program_id(0)
        t = tl.program_id(1) * BT + tl.arange(0, BT)
        e = tl.arange(0, HALF)
        live = t < T
        rows = j * 2 * HALF + e  # weight rows of the head's first half; + HALF: second half
        acc1 = tl.zeros([HALF, BT], tl.float32)
        acc2 = tl.zeros([HALF, BT], tl.float32)
        if PDL:
            gdc_wait()
        for k0 in range(0, K, BK):
            k = k0 + tl.arange(0, BK)
            x = tl.load(h_ptr + t[None, :] * K + k[:, None], mask=live[None, :] & (k[:, None] < K), other=0.0)
            w1 = tl.load(w_ptr + rows[:, None] * K + k[None, :], mask=k[None, :] < K, other=0.0)
            w2 = tl.load(w_ptr + (rows + HALF)[:, None] * K + k[None, :], mask=k[None, :] < K, other=0.0)
            acc1 = tl.dot(w1, x, acc1, input_precision=PREC)
            acc2 = tl.dot(w2, x, acc2, input_precision=PREC)
        if PDL:
            gdc_launch_dependents()
        if HAS_BIAS:
            acc1 += tl.load(b_ptr + rows).to(tl.float32)[:, None]
            acc2 += tl.load(b_ptr + rows + HALF).to(tl.float32)[:, None]
        dt = q_ptr.dtype.element_ty
        x1 = acc1.to(dt).to(tl.float32)  # the projection's output in the activation dtype
        x2 = acc2.to(dt).to(tl.float32)
        slot = tl.load(slot_ptr).to(tl.int64)
        t64 = t.to(tl.int64)
        if j < heads + kv_heads:  # q or k: rotate half
            c1 = tl.load(cos_ptr + t64[None, :] * s_cos + e[:, None], mask=live[None, :], other=0.0).to(
                tl.float32
            )
            c2 = tl.load(
                cos_ptr + t64[None, :] * s_cos + HALF + e[:, None], mask=live[None, :], other=0.0
            ).to(tl.float32)
            s1 = tl.load(sin_ptr + t64[None, :] * s_sin + e[:, None], mask=live[None, :], other=0.0).to(
                tl.float32
            )
            s2 = tl.load(
                sin_ptr + t64[None, :] * s_sin + HALF + e[:, None], mask=live[None, :], other=0.0
            ).to(tl.float32)
            y1 = x1 * c1 - x2 * s1
            y2 = x2 * c2 + x1 * s2
            if j < heads:
                dst = q_ptr + t64[None, :] * (heads * 2 * HALF) + j * 2 * HALF + e[:, None]
            else:
                dst = kc_ptr + t64[None, :] * s_cb + (j - heads) * s_ch + slot * s_ct + e[:, None]
            tl.store(dst, y1.to(dt), mask=live[None, :])
            tl.store(dst + HALF, y2.to(dt), mask=live[None, :])
        else:  # v: into the cache as is
            dst = vc_ptr + t64[None, :] * s_cb + (j - heads - kv_heads) * s_ch + slot * s_ct + e[:, None]
            tl.store(dst, x1.to(dt), mask=live[None, :])
            tl.store(dst + HALF, x2.to(dt), mask=live[None, :])

    @triton.jit
    def gate_up_silu(h_ptr, w_ptr, o_ptr, T, K, inter,
                     BN: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                     PREC: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
        n = tl.program_id(0) * BN + tl.arange(0, BN)
        t = tl.program_id(1) * BT + tl.arange(0, BT)
        live, rows = t < T, n < inter
        acc_g = tl.zeros([BN, BT], tl.float32)
        acc_u = tl.zeros([BN, BT], tl.float32)
        if PDL:
            gdc_wait()
        for k0 in range(0, K, BK):
            k = k0 + tl.arange(0, BK)
            x = tl.load(h_ptr + t[None, :] * K + k[:, None], mask=live[None, :] & (k[:, None] < K), other=0.0)
            wm = rows[:, None] & (k[None, :] < K)
            wg = tl.load(w_ptr + n[:, None] * K + k[None, :], mask=wm, other=0.0)
            wu = tl.load(w_ptr + (n + inter)[:, None] * K + k[None, :], mask=wm, other=0.0)
            acc_g = tl.dot(wg, x, acc_g, input_precision=PREC)
            acc_u = tl.dot(wu, x, acc_u, input_precision=PREC)
        if PDL:
            gdc_launch_dependents()
        dt = o_ptr.dtype.element_ty
        g = acc_g.to(dt).to(tl.float32)
        u = acc_u.to(dt).to(tl.float32)
        act = (g * tl.sigmoid(g)).to(dt).to(tl.float32)
        dst = o_ptr + t.to(tl.int64)[None, :] * inter + n[:, None]
        tl.store(dst, (act * u).to(dt), mask=live[None, :] & rows[:, None])

    @triton.jit
    def linear(x_ptr, w_ptr, b_ptr, o_ptr, T, K, N,
               BN: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, HAS_BIAS: tl.constexpr,
               PREC: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
        n = tl.program_id(0) * BN + tl.arange(0, BN)
        t = tl.program_id(1) * BT + tl.arange(0, BT)
        live, rows = t < T, n < N
        acc = tl.zeros([BN, BT], tl.float32)
        if PDL:
            gdc_wait()
        for k0 in range(0, K, BK):
            k = k0 + tl.arange(0, BK)
            x = tl.load(x_ptr + t[None, :] * K + k[:, None], mask=live[None, :] & (k[:, None] < K), other=0.0)
            w = tl.load(w_ptr + n[:, None] * K + k[None, :], mask=rows[:, None] & (k[None, :] < K), other=0.0)
            acc = tl.dot(w, x, acc, input_precision=PREC)
        if PDL:
            gdc_launch_dependents()
        if HAS_BIAS:
            acc += tl.load(b_ptr + n, mask=rows, other=0.0).to(tl.float32)[:, None]
        dst = o_ptr + t.to(tl.int64)[None, :] * N + n[:, None]
        tl.store(dst, acc.to(o_ptr.dtype.element_ty), mask=live[None, :] & rows[:, None])

    @triton.jit
    def add_rms_norm(x_ptr, d_ptr, w_ptr, s_ptr, h_ptr, N, eps,
                     BH: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
        r = tl.program_id(0).to(tl.int64)
        c = tl.arange(0, BH)
        m = c < N
        w = tl.load(w_ptr + c, mask=m, other=0.0)
        if PDL:
            gdc_wait()
        x = tl.load(x_ptr + r * N + c, mask=m, other=0.0)
        d = tl.load(d_ptr + r * N + c, mask=m, other=0.0)
        dt = s_ptr.dtype.element_ty
        s = (x.to(tl.float32) + d.to(tl.float32)).to(dt)  # the residual stream in the activation dtype
        tl.store(s_ptr + r * N + c, s, mask=m)
        sf = s.to(tl.float32)
        y = (sf * tl.rsqrt(tl.sum(sf * sf, axis=0) / N + eps)).to(dt)
        if PDL:
            gdc_launch_dependents()
        tl.store(h_ptr + r * N + c, (w.to(tl.float32) * y.to(tl.float32)).to(dt), mask=m)

    return SimpleNamespace(
        qkv_rope=qkv_rope, gate_up_silu=gate_up_silu, linear=linear, add_rms_norm=add_rms_norm
    )


@cache
def _kernels() -> SimpleNamespace:
    return make_kernels()


def pdl_available(device: torch.device) -> bool:
    """Programmatic dependent launch: CUDA compute capability 9.0+ and a Triton that exposes it."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] < 9:
        return False
    try:
        from triton.language.extra.cuda import gdc_wait  # noqa: F401
    except ImportError:
        return False
    return True


class LayerKernels:
    """Launchers of the fused kernels (see module doc) with fixed tilings.

    Tiles: ``T`` in blocks of up to 64 tokens; the query/key/value and gate/up projections
    handle 64 weight rows per program (a head; 32 gate + 32 up rows), the output and down
    projections 16 (enough programs to keep every SM streaming weights at ``T <= 64``).
    """

    def __init__(self, pdl: bool, kernels: SimpleNamespace | None = None) -> None:
        self.k = kernels or _kernels()
        self.launch = {**LAUNCH, **({"launch_pdl": True} if pdl else {})}
        self.pdl = pdl

    @staticmethod
    def _tiles(x: torch.Tensor) -> tuple[int, int, str]:
        import triton

        t, k = x.shape
        bt = min(64, max(16, triton.next_power_of_2(t)))
        prec = "ieee" if x.dtype == torch.float32 else "tf32"
        return bt, min(BLOCK_K, max(16, triton.next_power_of_2(k))), prec

    def qkv_rope(
        self,
        h: torch.Tensor,
        w: torch.Tensor,
        bias: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot: torch.Tensor,
        kv_heads: int,
        head_dim: int,
    ) -> torch.Tensor:
        """``h [T, hidden]`` -> rotated ``q [T, KV, G, D]``; rotated k and v go to cache slot
        ``slot`` of ``k_cache, v_cache [T, KV, L, D]`` (as :func:`.fast_prologue.rope_store`)."""
        import triton

        t, k = h.shape
        heads = w.shape[0] // head_dim - 2 * kv_heads
        q = h.new_empty(t, heads * head_dim)
        bt, bk, prec = self._tiles(h)
        sc = k_cache.stride()
        self.k.qkv_rope[(heads + 2 * kv_heads, triton.cdiv(t, bt))](
            h, w, bias if bias is not None else w, cos, sin, q, k_cache, v_cache, slot, t, k,
            cos.stride(0), sin.stride(0), sc[0], sc[1], sc[2], heads, kv_heads, HALF=head_dim // 2,
            BT=bt, BK=bk, HAS_BIAS=bias is not None, PREC=prec, PDL=self.pdl, **self.launch,
        )  # fmt: skip
        return q.view(t, kv_heads, heads // kv_heads, head_dim)

    def gate_up_silu(self, h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """``h [T, hidden]``, ``w = [W_gate; W_up] [2I, hidden]`` -> ``silu(h W_gateᵀ) * (h W_upᵀ)``."""
        import triton

        t, k = h.shape
        inter = w.shape[0] // 2
        out = h.new_empty(t, inter)
        bt, bk, prec = self._tiles(h)
        self.k.gate_up_silu[(triton.cdiv(inter, 32), triton.cdiv(t, bt))](
            h, w, out, t, k, inter, BN=32, BT=bt, BK=bk, PREC=prec, PDL=self.pdl, **self.launch
        )
        return out

    def linear(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x [T, K] wᵀ (+ bias)`` with ``w [N, K]``."""
        import triton

        t, k = x.shape
        n = w.shape[0]
        out = x.new_empty(t, n)
        bt, _, prec = self._tiles(x)
        bk = min(2 * BLOCK_K, max(16, triton.next_power_of_2(k)))
        self.k.linear[(triton.cdiv(n, 16), triton.cdiv(t, bt))](
            x, w, bias if bias is not None else w, out, t, k, n, BN=16, BT=bt, BK=bk,
            HAS_BIAS=bias is not None, PREC=prec, PDL=self.pdl, **{**self.launch, "num_stages": 3},
        )  # fmt: skip
        return out

    def add_rms_norm(
        self, x: torch.Tensor, d: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x + d, weight * rmsnorm(x + d))`` for ``[T, hidden]`` rows (as :func:`.fast_ops.add_rms_norm`)."""
        import triton

        t, n = x.shape
        s, h = torch.empty_like(x), torch.empty_like(x)
        launch = {**self.launch, "num_warps": 4, "num_stages": 1}
        self.k.add_rms_norm[(t,)](
            x, d, weight, s, h, n, eps, BH=triton.next_power_of_2(n), PDL=self.pdl, **launch
        )
        return s, h


def self_check(device: torch.device, pdl: bool) -> str | None:
    """None if every kernel matches its :mod:`.fast_ops` reference (fp32, 1e-4) on small random
    data here, else why not."""
    from megalith_chat.engine import fast_ops
    from megalith_chat.engine.fast_prologue import rope_store_reference

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

    def rand(*shape: int) -> torch.Tensor:  # weights scaled by 1/sqrt(fan-in): outputs of order one
        return (torch.randn(*shape, generator=gen) * (shape[-1] ** -0.5 if len(shape) == 2 else 1)).to(device)

    t, hidden, heads, kv, dim, inter = 5, 64, 4, 2, 32, 80
    h, x, d = (rand(t, hidden) * hidden**0.5 for _ in range(3))
    ln = rand(hidden)
    width = (heads + 2 * kv) * dim
    wqkv, bias, wgu, wd = rand(width, hidden), rand(width), rand(2 * inter, hidden), rand(hidden, inter)
    cos, sin = rand(t, dim), rand(t, dim)
    caches = [torch.zeros(t, kv, 7, dim, device=device) for _ in range(4)]
    slot = torch.tensor(3, device=device)
    try:
        lk = LayerKernels(pdl)
        got = [
            lk.qkv_rope(h, wqkv, bias, cos, sin, caches[0], caches[1], slot, kv, dim),
            lk.gate_up_silu(h, wgu),
            lk.linear(lk.gate_up_silu(h, wgu), wd, None),
            *lk.add_rms_norm(x, d, ln, 1e-6),
        ]
    except errors as exc:
        return repr(exc)
    # the references in float64: on CUDA a float32 matmul may run in TF32
    h, x, d, ln, wqkv, bias, wgu, wd, cos, sin = (
        a.double() for a in (h, x, d, ln, wqkv, bias, wgu, wd, cos, sin)
    )
    ref_caches = [c.double() for c in caches[2:]]
    want = [
        rope_store_reference(h @ wqkv.t() + bias, cos, sin, *ref_caches, slot, kv, dim),
        fast_ops.silu_mul(h @ wgu.t()),
        fast_ops.silu_mul(h @ wgu.t()) @ wd.t(),
        *fast_ops.add_rms_norm(x, d, ln, 1e-6),
    ]
    err = max(float((a.double() - b).abs().max()) for a, b in zip([*got, *caches[:2]], [*want, *ref_caches]))
    return None if err < 1e-4 else f"max abs error {err:.2e} against the torch ops"
