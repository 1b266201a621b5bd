"""Decode-size matmuls as one Triton kernel that splits K and reduces the split inside itself.

At decode sizes (``M`` = the batch, 64-256 rows) cuBLAS runs the 0.37B shape's projections at
0.7-1.6 TB/s on an H100 (``benchmarks/results/gpu_decode_gemm_h100.json``: ``down``, 5.8 MB of
weight, 7.9 µs): there are too few output tiles to keep every SM streaming weights, and where
cuBLAS splits K it adds a reduction kernel. Here the grid is ``(output tiles, SPLIT)``: each
program multiplies its range of K, writes its fp32 partial and increments its tile's counter; the
program that arrives last (the counter says so) sums the partials, applies the epilogue and resets
the counter to 0 for the next call, all in the same launch. Counters and partials live in
buffers kept per shape, so the call can be captured in a CUDA graph (the calls of one stream run
one after another, so they share them).

Epilogues (``a [M, K]``, ``w [N, K]`` row-major, as the engine stores its weights):

* ``"store"``: ``a wᵀ`` into a new ``[M, N]`` tensor;
* ``"residual"``: ``out += a wᵀ`` in place (the residual add: the sum is rounded once);
* ``"swiglu"``: ``w = [W_gate; W_up]`` (``2I`` rows) projecting the un-normalised residual stream
  ``a = x`` with the norm weight folded in (:mod:`.fast_weights`): ``silu(g r) * (u r)`` with ``r =
  1 / rms(x)``, whose sum of squares is accumulated from the same loads of ``x``, ``[M, I]`` out.
  This is the gate/up matmul and :func:`.fast_mlp.norm_silu_mul` in one launch.

The engine runs its decode projections with it when ``FastEngineConfig.fast_gemm`` is on (off by
default); ``benchmarks/gpu_decode_gemm.py`` times it against cuBLAS (variants ``triton``,
``triton_residual``, ``triton_swiglu``) and ``benchmarks/gpu_generate.py`` the engine with and
without it. The tests check it against torch in the Triton interpreter (``TRITON_INTERPRET=1``)
and compile it for sm_90.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from typing import Any, NamedTuple

import torch

from megalith.common.errors import ConfigError

EPILOGUES = {"store": 0, "residual": 1, "swiglu": 2}
DEFAULT_SMS = 132  # H100 / H200 SXM; used where the device cannot be asked (the interpreter)


@dataclass(frozen=True)
class GemmConfig:
    """Tile sizes and launch options; ``split=None`` picks enough K splits to give every SM a program."""

    block_n: int = 64
    block_k: int = 128
    split: int | None = None
    warps: int = 4
    stages: int = 3

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ConfigError(f"{name} must be a power of two >= 16, got {value}")
        if self.split is not None and self.split < 1:
            raise ConfigError(f"split must be >= 1, got {self.split}")

    @classmethod
    def parse(cls, text: str) -> GemmConfig:
        """``"<block_n>x<block_k>w<warps>s<stages>"`` (e.g. ``"64x128w4s3"``; split automatic)."""
        found = re.fullmatch(r"(\d+)x(\d+)w(\d+)s(\d+)", text.strip())
        if not found:
            raise ConfigError(f"{text!r} is not <block_n>x<block_k>w<warps>s<stages>, e.g. 64x128w4s3")
        bn, bk, warps, stages = map(int, found.groups())
        return cls(block_n=bn, block_k=bk, warps=warps, stages=stages)


class ProjectionConfigs(NamedTuple):
    """The tile configuration of each decode projection (the engine's ``gemm``)."""

    qkv: GemmConfig = GemmConfig()
    o: GemmConfig = GemmConfig()
    gate_up: GemmConfig = GemmConfig()
    down: GemmConfig = GemmConfig()


def make_kernel() -> Any:
    """The Triton kernel: :func:`._tile_gemm.skinny_gemm` on grid ``(tiles, split)``, the split-K
    tile matmul that :mod:`.fast_chain` runs inside its persistent kernels too (its module is
    imported on first use, when Triton reads ``TRITON_INTERPRET``)."""
    from megalith_chat.engine import _tile_gemm

    return _tile_gemm.skinny_gemm


_BUFFERS: dict[tuple[Any, ...], torch.Tensor] = {}


def _buffer(device: torch.device, dtype: torch.dtype, numel: int) -> torch.Tensor:
    """A zeroed buffer kept for the process: a graph captured with it keeps a valid pointer."""
    key = (device, dtype, numel)
    if key not in _BUFFERS:
        _BUFFERS[key] = torch.zeros(max(numel, 1), device=device, dtype=dtype)
    return _BUFFERS[key]


@cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


@dataclass(frozen=True)
class Plan:
    """How a call is cut: ``tiles`` output tiles of ``block_m x block_n``, K in ``split`` ranges."""

    block_m: int
    tiles: int
    split: int
    k_per_split: int


def plan(m: int, n: int, k: int, config: GemmConfig, sms: int = DEFAULT_SMS) -> Plan:
    block_m = min(64, max(16, 1 << (m - 1).bit_length()))
    tiles = -(-m // block_m) * -(-n // config.block_n)
    k_blocks = -(-k // config.block_k)
    split = config.split or max(1, round(sms / tiles))
    split = min(split, k_blocks)
    k_per_split = -(-k_blocks // split) * config.block_k
    return Plan(block_m, tiles, -(-k // k_per_split), k_per_split)


def gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    epilogue: str = "store",
    out: torch.Tensor | None = None,
    eps: float = 1e-6,
    config: GemmConfig | None = None,
    kernel: Any = None,
) -> torch.Tensor:
    """``a [M, K]`` times ``w [N, K]ᵀ`` with ``epilogue`` (module doc); ``out`` is required for
    ``"residual"`` (updated in place and returned) and not accepted otherwise."""
    if epilogue not in EPILOGUES:
        raise ConfigError(f"epilogue must be one of {sorted(EPILOGUES)}, got {epilogue!r}")
    if a.dim() != 2 or w.dim() != 2 or a.shape[1] != w.shape[1]:
        raise ConfigError(f"need a [M, K] and w [N, K], got {tuple(a.shape)} and {tuple(w.shape)}")
    if a.dtype != w.dtype:
        raise ConfigError(f"a and w need one dtype, got {a.dtype} and {w.dtype}")
    if a.stride(1) != 1 or w.stride(1) != 1:
        raise ConfigError("a and w need unit-stride rows")
    config = config or GemmConfig()
    m, k = a.shape
    n = w.shape[0] // 2 if epilogue == "swiglu" else w.shape[0]
    if epilogue == "swiglu" and w.shape[0] % 2:
        raise ConfigError(f"swiglu needs [W_gate; W_up] with an even row count, got {w.shape[0]}")
    if epilogue == "residual":
        if out is None or tuple(out.shape) != (m, n) or out.stride(1) != 1:
            raise ConfigError(f"residual needs out [{m}, {n}] with unit-stride rows")
    elif out is not None:
        raise ConfigError(f"out is only taken by the residual epilogue, not {epilogue!r}")
    else:
        out = a.new_empty(m, n)
    sms = _sm_count(a.device) if a.is_cuda else DEFAULT_SMS
    p = plan(m, n, k, config, sms)
    parts = 2 if epilogue == "swiglu" else 1
    partials = _buffer(
        a.device, torch.float32, p.split * p.tiles * parts * p.block_m * config.block_n if p.split > 1 else 0
    )
    ssq = _buffer(a.device, torch.float32, p.split * p.tiles * p.block_m if p.split > 1 and parts == 2 else 0)
    counters = _buffer(a.device, torch.int32, p.tiles)
    (kernel or make_kernel())[(p.tiles, p.split)](
        a, w, out, partials, ssq, counters, m, n, k, a.stride(0), w.stride(0), out.stride(0),
        p.k_per_split, eps, EPILOGUE=EPILOGUES[epilogue], SPLIT=p.split, BM=p.block_m,
        BN=config.block_n, BK=config.block_k, num_warps=config.warps, num_stages=config.stages,
    )  # fmt: skip
    return out
