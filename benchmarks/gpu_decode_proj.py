"""Decode-step projections of the fast engine: cuBLAS ``F.linear`` vs the split-K Triton kernel of
``megalith_chat.engine.fast_linear``, at the 0.37B shape of gpu_generate.py.

Each case runs the projection over 24 layers' worth of distinct weights (so weights come from HBM,
as in a decode step) inside one CUDA graph and reports microseconds per projection and the weight
bandwidth that implies (weight bytes / time). Cases: the attention output projection (``N = K =
1024``) and the MLP down projection (``N = 1024``, ``K = 2816``) preceded by the engine's SwiGLU
kernel (compiled), as the engine runs them, at 16, 32 and 64 rows. The split-K time excludes the
sum of its partials, which the engine does inside its residual add + RMSNorm kernel.

    python benchmarks/gpu_decode_proj.py   # a CUDA GPU; writes results/gpu_decode_proj_h200.json
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write_result

LAYERS, HIDDEN, INTER = 24, 1024, 2816


def graph_us(fn: Callable[[], Any], reps: int = 20) -> float:
    """Microseconds per replay of a CUDA graph of ``fn`` (warmed up on a side stream first)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps * 1e3


def measure(rows: int) -> dict[str, float]:
    from megalith_chat.engine import fast_ops
    from megalith_chat.engine.fast_linear import splitk_linear

    kw: dict[str, Any] = {"device": "cuda", "dtype": torch.bfloat16}
    wo = [torch.randn(HIDDEN, HIDDEN, **kw) * 0.03 for _ in range(LAYERS)]
    wd = [torch.randn(HIDDEN, INTER, **kw) * 0.03 for _ in range(LAYERS)]
    attn, gate_up = torch.randn(rows, HIDDEN, **kw), torch.randn(rows, 2 * INTER, **kw)
    silu = torch.compile(fast_ops.silu_mul, dynamic=True)
    out = {
        "o_cublas_us": graph_us(lambda: [F.linear(attn, w) for w in wo]) / LAYERS,
        "o_splitk_us": graph_us(lambda: [splitk_linear(attn, w) for w in wo]) / LAYERS,
        "down_cublas_us": graph_us(lambda: [F.linear(silu(gate_up), w) for w in wd]) / LAYERS,
        "down_splitk_us": graph_us(lambda: [splitk_linear(silu(gate_up), w) for w in wd]) / LAYERS,
        "swiglu_alone_us": graph_us(lambda: [silu(gate_up) for _ in wd]) / LAYERS,
    }
    for name, nbytes in (("o", HIDDEN * HIDDEN * 2), ("down", HIDDEN * INTER * 2)):
        for kind in ("cublas", "splitk"):
            out[f"{name}_{kind}_TBps"] = nbytes / out[f"{name}_{kind}_us"] / 1e6
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--rows", type=int, nargs="+", default=[16, 32, 64], help="decode rows (default 16 32 64)"
    )
    parser.add_argument("--out", default="gpu_decode_proj_h200.json", help="results file name")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_decode_proj.py needs a CUDA GPU (the split-K kernel's CPU check is a test)")
    cases = {}
    for rows in args.rows:
        cases[str(rows)] = measure(rows)
        print(rows, {k: round(v, 2) for k, v in cases[str(rows)].items()}, flush=True)
    shape = {"layers": LAYERS, "hidden": HIDDEN, "intermediate": INTER}
    print(f"wrote {write_result(args.out, {'shape': shape, 'rows': cases})}")


if __name__ == "__main__":
    main()
