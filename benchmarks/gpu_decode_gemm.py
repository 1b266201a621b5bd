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
  bound on what keeping the weights in L2 (e.g. prefetching them ahead of their matmul) could gain.

Each variant is captured in a CUDA graph over 24 layers of distinct weights (620 MB, far past the
L2 cache, as in the decode step) and replayed; time per call = replay time / 24.

    python benchmarks/gpu_decode_gemm.py            # rows 64 and 256 -> results/gpu_decode_gemm_<card>.json (h200, h100, ...)
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


def variants(name: str, rows: int) -> dict[str, Any]:
    """The formulations of projection ``name`` over ``LAYERS`` weights, each a callable."""
    import torch
    import torch.nn.functional as F

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
    return out


def measure(rows: int) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for name, (n, k) in SHAPES.items():
        row = {v: time_graph(fn) / LAYERS for v, fn in variants(name, rows).items()}
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
    args = p.parse_args()
    result = {
        "unit": "microseconds per call, graph-replayed over 24 layers of distinct weights",
        "rows": {r: measure(int(r)) for r in args.rows.split(",")},
    }
    print("wrote", write_result(args.out or f"gpu_decode_gemm_{card()}.json", result))


if __name__ == "__main__":
    main()
