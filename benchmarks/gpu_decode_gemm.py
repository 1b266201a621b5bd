"""Decode-step projections of the 0.37B generation shape, by matmul formulation (H200).

At decode sizes (64 rows) every projection is a small, memory-bound matmul whose time is mostly
fixed cost, and cuBLAS picks a different kernel for each formulation of the same product. This
measures, per projection (qkv, o, gate_up, down) and rows, the microseconds per call of:

* ``linear``: ``F.linear(x, W)``, ``W [N, K]`` row-major (the engine's storage);
* ``linear_t``: ``x @ W_t``, the weight stored transposed (``W_t [K, N]`` row-major);
* ``bias``: ``F.linear(x, W, 0)``, a zero bias (cuBLASLt with a bias epilogue);
* ``addmm``: ``y.addmm_(x, W.t())``, the residual add inside the matmul (o and down, the engine's
  current form), and ``addmm_t`` with the transposed storage;
* ``linear_l2``: ``F.linear`` on one weight 24 times, so that it is read from the L2 cache: the
  bound on what keeping the weights in L2 (e.g. prefetching them ahead of their matmul) could gain;
* ``triton[...]``: the split-K kernel of ``megalith_chat.engine.fast_gemm`` (K split in-kernel so
  that about one program runs per SM, the last program of a tile reducing), per tile configuration
  of ``--triton-configs``; ``triton_residual[...]`` its in-place residual epilogue (o and down,
  against ``addmm``), ``triton_swiglu[...]`` the gate/up matmul with the norm's ``1 / rms(x)`` and
  SwiGLU in its epilogue (gate_up), against ``linear_swiglu``: ``F.linear`` then the engine's
  norm + SwiGLU kernel (``fast_mlp``), the two launches it replaces.

Each variant is captured in a CUDA graph over 24 layers of distinct weights (620 MB, far past the
L2 cache, as in the decode step) and replayed; time per call = replay time / 24.

    python benchmarks/gpu_decode_gemm.py            # rows 64 and 256 -> results/gpu_decode_gemm_<card>.json (h200, h100, ...)
    python benchmarks/gpu_decode_gemm.py --rows 64 --triton-configs 64x128w4s3,32x128w4s4
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import card, write_result

HIDDEN, INTER, QKV, LAYERS = 1024, 2816, 3 * 1024, 24
SHAPES = {
    "qkv": (QKV, HIDDEN),
    "o": (HIDDEN, HIDDEN),
    "gate_up": (2 * INTER, HIDDEN),
    "down": (HIDDEN, INTER),
}
RESIDUAL = ("o", "down")
TRITON_CONFIGS = "64x128w4s3,32x128w4s3,64x64w4s4,128x64w4s3,32x256w4s3"


def parse_config(text: str) -> Any:
    """``<block_n>x<block_k>w<warps>s<stages>`` (split: automatic) -> ``GemmConfig``."""
    from megalith.common.errors import ConfigError
    from megalith_chat.engine.fast_gemm import GemmConfig

    try:
        return GemmConfig.parse(text)
    except ConfigError as exc:
        raise SystemExit(f"--triton-configs: {exc}") from exc


def time_graph(fn: Any, reps: int = 50) -> float:
    """Microseconds per replay of ``fn`` captured in a CUDA graph."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(5):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps * 1e3


def variants(name: str, rows: int, configs: dict[str, Any]) -> dict[str, Any]:
    """The formulations of projection ``name`` over ``LAYERS`` weights, each a callable."""
    import torch
    import torch.nn.functional as F

    from megalith_chat.engine.fast_gemm import gemm
    from megalith_chat.engine.fast_mlp import norm_silu_mul

    n, k = SHAPES[name]
    kw: dict[str, Any] = {"device": "cuda", "dtype": torch.bfloat16}
    weights = [torch.randn(n, k, **kw) * 0.02 for _ in range(LAYERS)]
    transposed = [w.t().contiguous() for w in weights]
    zero = torch.zeros(n, **kw)
    x, y = torch.randn(rows, k, **kw), torch.randn(rows, n, **kw)
    out = {
        "linear": lambda: [F.linear(x, w) for w in weights],
        "linear_t": lambda: [x @ w for w in transposed],
        "bias": lambda: [F.linear(x, w, zero) for w in weights],
        "linear_l2": lambda: [F.linear(x, weights[0]) for _ in weights],
    }
    if name in RESIDUAL:
        out["addmm"] = lambda: [y.addmm_(x, w.t()) for w in weights]
        out["addmm_t"] = lambda: [y.addmm_(x, w) for w in transposed]
    if name == "gate_up":
        out["linear_swiglu"] = lambda: [norm_silu_mul(F.linear(x, w), x, 1e-5) for w in weights]
    for tag, cfg in configs.items():
        out[f"triton[{tag}]"] = lambda cfg=cfg: [gemm(x, w, config=cfg) for w in weights]
        if name in RESIDUAL:
            out[f"triton_residual[{tag}]"] = lambda cfg=cfg: [
                gemm(x, w, "residual", out=y, config=cfg) for w in weights
            ]
        if name == "gate_up":
            out[f"triton_swiglu[{tag}]"] = lambda cfg=cfg: [
                gemm(x, w, "swiglu", eps=1e-5, config=cfg) for w in weights
            ]
    return out


def check(rows: int, configs: dict[str, Any]) -> dict[str, float]:
    """Largest relative error of each Triton epilogue against torch, over every configuration (bf16)."""
    import torch
    import torch.nn.functional as F

    from megalith_chat.engine.fast_gemm import gemm
    from megalith_chat.engine.fast_ops import norm_silu_mul

    kw: dict[str, Any] = {"device": "cuda", "dtype": torch.bfloat16}
    worst = {"store": 0.0, "residual": 0.0, "swiglu": 0.0}
    rel = lambda got, ref: float((got.float() - ref.float()).abs().max() / ref.float().abs().max())  # noqa: E731
    for name, (n, k) in SHAPES.items():
        x, w, y = torch.randn(rows, k, **kw), torch.randn(n, k, **kw) * 0.02, torch.randn(rows, n, **kw)
        for cfg in configs.values():
            worst["store"] = max(worst["store"], rel(gemm(x, w, config=cfg), F.linear(x, w)))
            got = gemm(x, w, "residual", out=y.clone(), config=cfg)
            worst["residual"] = max(worst["residual"], rel(got, y.clone().addmm_(x, w.t())))
            if name == "gate_up":
                ref = norm_silu_mul(F.linear(x, w), x, 1e-5)
                worst["swiglu"] = max(worst["swiglu"], rel(gemm(x, w, "swiglu", eps=1e-5, config=cfg), ref))
    return worst


def measure(rows: int, configs: dict[str, Any]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for name, (n, k) in SHAPES.items():
        row = {v: time_graph(fn) / LAYERS for v, fn in variants(name, rows, configs).items()}
        row["weight_MB"] = n * k * 2 / 1e6
        out[name] = row
        print(rows, name, {v: round(t, 2) for v, t in row.items()}, flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="64,256", help="comma-separated row counts (default: 64,256)")
    p.add_argument(
        "--out",
        default=None,
        help="result file (under benchmarks/results/ unless a path; default gpu_decode_gemm_<card>.json)",
    )
    p.add_argument(
        "--triton-configs",
        default=TRITON_CONFIGS,
        help="comma-separated split-K kernel tiles <block_n>x<block_k>w<warps>s<stages>, '' for none "
        f"(default: {TRITON_CONFIGS})",
    )
    args = p.parse_args()
    configs = {c: parse_config(c) for c in args.triton_configs.split(",") if c}
    rows = [int(r) for r in args.rows.split(",")]
    result = {
        "unit": "microseconds per call, graph-replayed over 24 layers of distinct weights",
        "triton_max_rel_err": {r: check(r, configs) for r in rows} if configs else {},
        "rows": {r: measure(r, configs) for r in rows},
    }
    print("wrote", write_result(args.out or f"gpu_decode_gemm_{card()}.json", result))


if __name__ == "__main__":
    main()
