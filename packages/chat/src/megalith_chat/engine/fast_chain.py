"""The decode step's projections of every layer in one persistent Triton launch (a measured
prototype: the engine does not use it).

At decode sizes each projection is a few megabytes of weights read in 4-7 µs, of which about
3 µs are fixed cost per launch (ramp-up, tail, the gap to the next kernel in the graph;
``benchmarks/results/gpu_decode_gemm_h100.json``). Here ``programs`` programs (one per SM) stay
resident for the whole stack and meet at a grid-wide barrier between projections instead of
ending a kernel: an arrival counter in global memory that each program increments (release) and
polls (acquire) until all have arrived. Per layer, with ``x [M, H]`` the residual stream:

    t = x Wqkvᵀ                      [M, 3H]
    x += t[:, :H] Woᵀ                (the attention's place: its output stands in by q)
    s = silu(x Wgᵀ) · (x Wuᵀ)        [M, I]   (Wgu = [Wg; Wu])
    x += s Wdᵀ

Each projection is cut as :func:`.fast_gemm.plan` cuts it (output tiles of ``block_n`` columns ×
all rows, K split as far as one round of tasks allows, :func:`cut`); the last program of a tile to finish
sums the tile's float32 partials in split order (deterministic) and applies the epilogue. Loads of
anything written inside the launch bypass L1 (``.cg``). A barrier that waits longer than its spin
limit (a program that never became resident) sets an error flag instead of hanging.

:func:`mlp_block` is the same machinery for the part of one decode layer after its attention (o
with the residual; 1 / rms, gate/up and SwiGLU; down with the residual: one launch instead of the
engine's four). ``benchmarks/gpu_decode_chain.py`` times both against the same work as cuBLAS
launches in a CUDA graph (the chat README has the figures: the chain −8 % per layer at 64 rows,
the block −2 %, which end to end in the engine was within noise, so the engine keeps its
launches). The tests run them in the Triton interpreter, where the programs run one after
another, so only one program is launched there (every barrier is then passed at once).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cache
from typing import Any

import torch

from megalith.common.errors import ConfigError
from megalith_chat.engine.fast_gemm import GemmConfig, Plan, plan

SPIN_LIMIT = 1 << 20  # polls of one barrier before it gives up and flags an error
PHASES = ("qkv", "o", "gate_up", "down")


@cache
def _kernels() -> Any:
    """The Triton kernels' module, imported on first use (Triton reads ``TRITON_INTERPRET`` then)."""
    from megalith_chat.engine import _chain_kernel

    return _chain_kernel


@dataclass(frozen=True)
class ChainWeights:
    """Every layer's projection weights, stacked: ``qkv [L, 3H, H]``, ``o [L, H, H]``, ``gate_up
    [L, 2I, H]`` (``[Wg; Wu]``) and ``down [L, H, I]``, row-major ``[N, K]`` as the engine stores them."""

    qkv: torch.Tensor
    o: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor

    def __post_init__(self) -> None:
        layers, hidden, inter = self.qkv.shape[0], self.qkv.shape[-1], self.down.shape[-1]
        want = {
            "qkv": (layers, 3 * hidden, hidden),
            "o": (layers, hidden, hidden),
            "gate_up": (layers, 2 * inter, hidden),
            "down": (layers, hidden, inter),
        }
        for name, shape in want.items():
            t = getattr(self, name)
            if tuple(t.shape) != shape:
                raise ConfigError(f"ChainWeights.{name}: shape {tuple(t.shape)}, expected {shape}")
            if not t.is_contiguous() or t.dtype != self.qkv.dtype or t.device != self.qkv.device:
                raise ConfigError(
                    f"ChainWeights.{name}: needs a contiguous {self.qkv.dtype} tensor on {self.qkv.device}"
                )

    @property
    def layers(self) -> int:
        return self.qkv.shape[0]

    @property
    def hidden(self) -> int:
        return self.qkv.shape[2]

    @property
    def inter(self) -> int:
        return self.down.shape[2]

    def shapes(self) -> dict[str, tuple[int, int]]:
        """(N, K) of each projection, by phase (gate/up: N = I outputs from 2I weight rows)."""
        h, i = self.hidden, self.inter
        return {"qkv": (3 * h, h), "o": (h, h), "gate_up": (i, h), "down": (h, i)}


def cut(
    shapes: dict[str, tuple[int, int]], rows: int, configs: dict[str, GemmConfig], programs: int
) -> dict[str, Plan]:
    """How each projection ``name: (N, K)`` is cut for ``programs`` programs (:func:`.fast_gemm.plan`).
    Unless a config fixes ``split``, K is split as far as one round of tasks allows (tiles × split
    ≤ programs): a second round would take as long as the first, whatever its size."""
    block_k = {configs[name].block_k for name in shapes}
    if len(block_k) != 1:
        raise ConfigError(f"every phase needs one block_k, got {sorted(block_k)}")
    out = {}
    for name, (n, k) in shapes.items():
        cfg = configs[name]
        if cfg.split is None:
            tiles = -(-rows // 64) * -(-n // cfg.block_n)
            cfg = dataclasses.replace(cfg, split=max(1, programs // tiles))
        out[name] = plan(rows, n, k, cfg, sms=programs)
    return out


@dataclass
class ChainBuffers:
    """Scratch of one ``(weights, rows, configs, programs)``: kept, so a CUDA graph can capture calls."""

    t: torch.Tensor
    s: torch.Tensor
    partials: torch.Tensor
    counters: torch.Tensor
    sync: torch.Tensor  # [barrier arrivals, error flag], zeroed by each call

    @property
    def barrier(self) -> torch.Tensor:
        return self.sync[0]

    @property
    def error(self) -> torch.Tensor:
        return self.sync[1]


_BUFFERS: dict[tuple[Any, ...], ChainBuffers] = {}


def _buffers(weights: ChainWeights, rows: int, p: dict[str, Plan], block_n: dict[str, int]) -> ChainBuffers:
    key = (weights.qkv.device, weights.qkv.dtype, weights.hidden, weights.inter, rows, tuple(p.items()),
           tuple(block_n.items()))  # fmt: skip
    if key not in _BUFFERS:
        dev, dt = weights.qkv.device, weights.qkv.dtype
        block_m = p["qkv"].block_m
        partial = max(
            (2 if name == "gate_up" else 1) * q.split * q.tiles * block_m * block_n[name]
            for name, q in p.items()
        )
        _BUFFERS[key] = ChainBuffers(
            t=torch.zeros(rows, 3 * weights.hidden, device=dev, dtype=dt),
            s=torch.zeros(rows, weights.inter, device=dev, dtype=dt),
            partials=torch.zeros(partial, device=dev, dtype=torch.float32),
            counters=torch.zeros(sum(q.tiles for q in p.values()), device=dev, dtype=torch.int32),
            sync=torch.zeros(2, device=dev, dtype=torch.int32),
        )
    return _BUFFERS[key]


# the fastest tile of ``benchmarks/results/gpu_decode_chain_h100.json`` (64 and 32 rows)
DEFAULT_TILE = GemmConfig(block_n=32, block_k=128, stages=4)


def default_configs() -> dict[str, GemmConfig]:
    return dict.fromkeys(PHASES, DEFAULT_TILE)


def run_chain(
    x: torch.Tensor,
    weights: ChainWeights,
    programs: int | None = None,
    configs: dict[str, GemmConfig] | None = None,
    prefetch: int = 0,
    idle_prefetch: bool = False,
) -> ChainBuffers:
    """Run every layer's chain on ``x [M, H]`` in place (module doc) in one launch of ``programs``
    programs (default: one per SM; 1 in the interpreter). Returns the scratch buffers, whose
    ``error`` is 1 if a barrier gave up waiting (then ``x`` is not to be trusted).

    ``prefetch`` = D > 0 (CUDA only): as each projection starts, every program asks L2 for its
    weights of the projection D ahead (1 the next one, 4 the same one of the next layer; Hopper
    bulk prefetches, K·2 bytes a multiple of 16); 0 none. ``idle_prefetch`` (CUDA only): the
    programs without a task in a projection ask L2 for the weights of the next ones instead (qkv's
    idle programs for o and gate/up, gate/up's for down and the next layer's qkv).
    """
    if x.dim() != 2 or x.shape[1] != weights.hidden or not x.is_contiguous():
        raise ConfigError(f"x must be contiguous [M, {weights.hidden}], got {tuple(x.shape)}")
    if x.dtype != weights.qkv.dtype or x.device != weights.qkv.device:
        raise ConfigError(
            f"x is {x.dtype} on {x.device}, the weights {weights.qkv.dtype} on {weights.qkv.device}"
        )
    rows = x.shape[0]
    if not 1 <= rows <= 64:
        raise ConfigError(f"the chain takes 1-64 rows (one row tile), got {rows}")
    configs = {**default_configs(), **(configs or {})}
    if set(configs) != set(PHASES):
        raise ConfigError(f"configs are keyed by {PHASES}, got {sorted(configs)}")
    programs = _programs(x, programs)
    if not 0 <= prefetch <= 4:
        raise ConfigError(f"prefetch must be 0-4 projections ahead, got {prefetch}")
    if (prefetch or idle_prefetch) and (
        not x.is_cuda or x.dtype != torch.bfloat16 or weights.hidden % 8 or weights.inter % 8
    ):
        raise ConfigError("prefetch needs bf16 weights on a CUDA device with hidden and inter multiples of 8")
    p = cut(weights.shapes(), rows, configs, programs)
    block_n = {name: c.block_n for name, c in configs.items()}
    buf = _buffers(weights, rows, p, block_n)
    buf.sync.zero_()
    q, o, gu, d = (p[n] for n in PHASES)
    _kernels().chain[(programs,)](
        x, buf.t, buf.s, weights.qkv, weights.o, weights.gate_up, weights.down, buf.partials,
        buf.counters, buf.sync, buf.sync[1:], rows, weights.layers, weights.hidden, weights.inter,
        q.k_per_split, o.k_per_split, gu.k_per_split, d.k_per_split,
        SP0=q.split, SP1=o.split, SP2=gu.split, SP3=d.split,
        BN0=block_n["qkv"], BN1=block_n["o"], BN2=block_n["gate_up"], BN3=block_n["down"],
        BM=q.block_m, BK=configs["qkv"].block_k, SPIN=SPIN_LIMIT, PREFETCH=prefetch, IDLE=idle_prefetch,
        num_warps=configs["qkv"].warps, num_stages=configs["qkv"].stages,
    )  # fmt: skip
    return buf


def _programs(x: torch.Tensor, programs: int | None) -> int:
    """One program per SM by default (1 in the interpreter, which runs programs one after another)."""
    if programs is None:
        return torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 1
    if programs < 1:
        raise ConfigError(f"programs must be >= 1, got {programs}")
    return programs


BLOCK_PHASES = ("o", "gate_up", "down")


@dataclass
class BlockBuffers:
    """Scratch of one :func:`mlp_block` shape and cut: kept, so a CUDA graph can capture calls."""

    s: torch.Tensor
    partials: torch.Tensor
    ssq: torch.Tensor  # float32 partial sums of squares of x, where gate/up splits K
    counters: torch.Tensor
    sync: torch.Tensor  # [barrier arrivals, error flag, exits]; the kernel resets 0 and 2 itself


_BLOCK_BUFFERS: dict[tuple[Any, ...], BlockBuffers] = {}


def mlp_block(
    x: torch.Tensor,
    attn: torch.Tensor,
    wo: torch.Tensor,
    wgu: torch.Tensor,
    wd: torch.Tensor,
    eps: float,
    programs: int | None = None,
    configs: dict[str, GemmConfig] | None = None,
) -> torch.Tensor:
    """A decode layer after its attention in one persistent launch (two grid-wide barriers):

        x += attn Woᵀ;   s = silu(g r) · (u r),  [g | u] = x Wguᵀ,  r = 1 / rms(x);   x += s Wdᵀ

    ``x [M, H]`` (updated in place and returned), ``attn [M, Q]``, ``wo [H, Q]``, ``wgu [2I, H]``
    (``[W_gate; W_up]`` with the norm weight folded in, as :mod:`.fast_weights` stores it),
    ``wd [H, I]``; 1-64 rows. The same result as the engine's ``addmm`` + ``linear`` +
    :func:`.fast_mlp.norm_silu_mul` + ``addmm`` (four launches). The kernel resets its barrier
    counts at its end, so calls capture in a CUDA graph without a memset between them."""
    rows, hidden = x.shape if x.dim() == 2 else (0, 0)
    inter, q_width = wd.shape[-1], attn.shape[-1]
    want = {
        "x": (rows, hidden),
        "attn": (rows, q_width),
        "wo": (hidden, q_width),
        "wgu": (2 * inter, hidden),
        "wd": (hidden, inter),
    }
    for name, t in (("x", x), ("attn", attn), ("wo", wo), ("wgu", wgu), ("wd", wd)):
        if t.dim() != 2 or tuple(t.shape) != want[name] or not t.is_contiguous():
            raise ConfigError(
                f"mlp_block: {name} must be contiguous {list(want[name])}, got {tuple(t.shape)}"
            )
        if t.dtype != x.dtype or t.device != x.device:
            raise ConfigError(f"mlp_block: {name} is {t.dtype} on {t.device}, x {x.dtype} on {x.device}")
    if not 1 <= rows <= 64:
        raise ConfigError(f"mlp_block takes 1-64 rows (one row tile), got {rows}")
    configs = {**dict.fromkeys(BLOCK_PHASES, DEFAULT_TILE), **(configs or {})}
    if set(configs) != set(BLOCK_PHASES):
        raise ConfigError(f"configs are keyed by {BLOCK_PHASES}, got {sorted(configs)}")
    programs = _programs(x, programs)
    shapes = {"o": (hidden, q_width), "gate_up": (inter, hidden), "down": (hidden, inter)}
    p = cut(shapes, rows, configs, programs)
    o, gu, d = (p[n] for n in BLOCK_PHASES)
    block_n = {name: configs[name].block_n for name in BLOCK_PHASES}
    key = (x.device, x.dtype, rows, hidden, inter, q_width, tuple(p.items()), tuple(block_n.items()))
    if key not in _BLOCK_BUFFERS:
        partial = max(
            (2 if n == "gate_up" else 1) * q.split * q.tiles * q.block_m * block_n[n] for n, q in p.items()
        )
        _BLOCK_BUFFERS[key] = BlockBuffers(
            s=x.new_zeros(rows, inter),
            partials=torch.zeros(partial, device=x.device, dtype=torch.float32),
            ssq=torch.zeros(gu.split * gu.tiles * gu.block_m, device=x.device, dtype=torch.float32),
            counters=torch.zeros(sum(q.tiles for q in p.values()), device=x.device, dtype=torch.int32),
            sync=torch.zeros(3, device=x.device, dtype=torch.int32),
        )
    buf = _BLOCK_BUFFERS[key]
    _kernels().mlp_block[(programs,)](
        attn, x, buf.s, wo, wgu, wd, buf.partials, buf.ssq, buf.counters, buf.sync,
        rows, hidden, inter, q_width, eps, o.k_per_split, gu.k_per_split, d.k_per_split,
        SP1=o.split, SP2=gu.split, SP3=d.split, BN1=block_n["o"], BN2=block_n["gate_up"],
        BN3=block_n["down"], BM=o.block_m, BK=configs["o"].block_k, SPIN=SPIN_LIMIT,
        num_warps=configs["o"].warps, num_stages=configs["o"].stages,
    )  # fmt: skip
    return x


def block_error(x: torch.Tensor) -> bool:
    """Whether an :func:`mlp_block` call on ``x``'s device gave up at a barrier (a program that
    never became resident) since the flag was last cleared; clears it."""
    flagged = False
    for key, buf in _BLOCK_BUFFERS.items():
        if key[0] == x.device:
            flagged |= bool(buf.sync[1])
            buf.sync[1] = 0
    return flagged


def reference_chain(x: torch.Tensor, weights: ChainWeights) -> torch.Tensor:
    """The same chain in torch, one op after another (a new tensor; ``x`` is left alone)."""
    import torch.nn.functional as F

    x = x.clone()
    h, i = weights.hidden, weights.inter
    for layer in range(weights.layers):
        t = F.linear(x, weights.qkv[layer])
        x = x + F.linear(t[:, :h], weights.o[layer])
        gu = F.linear(x, weights.gate_up[layer])
        s = F.silu(gu[:, :i]) * gu[:, i:]
        x = x + F.linear(s, weights.down[layer])
    return x
