"""The decode step's projections of 24 layers (0.37B generation shape) in one persistent launch
against one launch per operation.

Per layer: ``t = x Wqkvᵀ; x += t[:, :H] Woᵀ; s = silu(x Wgᵀ)·(x Wuᵀ); x += s Wdᵀ`` (the attention is
left out; q stands in for its output). Variants, each captured in a CUDA graph and replayed:

* ``cublas``: the chain as the engine runs it: ``F.linear`` for qkv and gate/up, ``addmm_`` with the
  residual for o and down, and megalith's SwiGLU kernel: five launches per layer;
* ``chain[<config>,p<mode>]``: :mod:`megalith_chat.engine.fast_chain`, every layer in one launch
  of one program per SM, grid-wide barriers between the projections; ``<config>`` is the tile
  ``<block_n>x<block_k>w<warps>s<stages>`` of every projection, ``<mode>`` how many projections
  ahead each program asks L2 for its weights as a projection starts (0 none, 4 = one layer ahead;
  ``i``: the programs idle in qkv and gate/up ask for the next projections' weights instead);
* ``barriers[<config>]``: the same launch over 24 layers of hidden = inter = 64 (a few KB of
  weights): what the 96 barriers and the projections' fixed costs take without the streaming;
* ``floor``: the layers' weights read once at the copy bandwidth measured in the same run;
* ``block_cublas`` / ``block_persistent``: the engine's post-attention part of a layer (o with the
  residual; gate/up, then 1 / rms and SwiGLU by ``fast_mlp.norm_silu_mul``; down with the residual:
  four launches) against :func:`megalith_chat.engine.fast_chain.mlp_block` (one launch), 24 layers.

Reported: microseconds per layer (replay time / 24), the achieved weight bandwidth, and each
chain's largest error against ``cublas`` (bf16) relative to the largest change the layers made to ``x`` and its barrier error flag.

    python benchmarks/gpu_decode_chain.py                 # -> results/gpu_decode_chain_<card>.json
    python benchmarks/gpu_decode_chain.py --rows 64 --configs 32x128w4s3,16x128w4s3
"""

from __future__ import annotations

import argparse
import functools
import itertools
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import card, write_result
from gpu_decode_gemm import HIDDEN, INTER, LAYERS, parse_config, time_graph
from gpu_generate import copy_bandwidth

CONFIGS = "32x128w4s4,16x128w4s4,32x64w4s4,64x64w4s4,64x128w8s3"


def block_ab(x0: Any, w: Any, kw: dict[str, Any]) -> dict[str, Any]:
    """µs per layer of the post-attention part: cuBLAS + the norm/SwiGLU kernel vs ``mlp_block``."""
    import torch

    from megalith_chat.engine.fast_chain import block_error, mlp_block
    from megalith_chat.engine.fast_mlp import norm_silu_mul

    rows = x0.shape[0]
    attn = torch.randn(rows, HIDDEN, **kw)
    x = x0.clone()

    def cublas(x: Any = x) -> None:
        for layer in range(LAYERS):
            x.addmm_(attn, w.o[layer].t())
            x.addmm_(
                norm_silu_mul(torch.nn.functional.linear(x, w.gate_up[layer]), x, 1e-5), w.down[layer].t()
            )

    def persistent(x: Any = x) -> None:
        for layer in range(LAYERS):
            mlp_block(x, attn, w.o[layer], w.gate_up[layer], w.down[layer], 1e-5)

    x.copy_(x0)
    cublas()
    ref = x.float().clone()
    x.copy_(x0)
    persistent()
    err = float((x.float() - ref).abs().max() / (ref - x0.float()).abs().max())
    out = {"block_cublas": {"us": time_graph(cublas) / LAYERS}}
    out["block_persistent"] = {"us": time_graph(persistent) / LAYERS, "max_rel_err": err}
    out["block_persistent"]["barrier_error"] = int(block_error(x))
    return out


def parse_modes(text: str) -> list[str]:
    """``--prefetch``: distances ``0``-``4`` and ``i`` (idle programs prefetch), comma-separated."""
    modes = [m.strip() for m in text.split(",") if m.strip()]
    for m in modes:
        if m != "i" and not (m.isdigit() and int(m) <= 4):
            raise SystemExit(f"--prefetch: {m!r} is neither a distance 0-4 nor 'i'")
    return modes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="64,32", help="comma-separated row counts, each 1-64 (default: 64,32)")
    p.add_argument(
        "--configs",
        default=CONFIGS,
        help=f"comma-separated chain tiles <block_n>x<block_k>w<warps>s<stages> (default: {CONFIGS})",
    )
    p.add_argument(
        "--prefetch",
        default="0,i",
        help="comma-separated prefetch modes of each chain: distances 0-4 (projections ahead; 0 none) "
        "or i (the programs idle in a projection prefetch for the next ones) (default: 0,i)",
    )
    p.add_argument(
        "--out",
        default=None,
        help="result file (under benchmarks/results/; default gpu_decode_chain_<card>.json)",
    )
    args = p.parse_args()

    import torch

    from megalith.kernels.ops_triton import swiglu_fwd
    from megalith_chat.engine.fast_chain import PHASES, ChainWeights, run_chain

    if not torch.cuda.is_available():
        raise SystemExit("gpu_decode_chain.py needs a CUDA GPU (the tests run the chain on the CPU)")
    configs = {c: parse_config(c) for c in args.configs.split(",") if c}
    modes = parse_modes(args.prefetch)
    kw: dict[str, Any] = {"device": "cuda", "dtype": torch.bfloat16}
    h, i = HIDDEN, INTER
    w = ChainWeights(
        torch.randn(LAYERS, 3 * h, h, **kw) * 0.01,
        torch.randn(LAYERS, h, h, **kw) * 0.01,
        torch.randn(LAYERS, 2 * i, h, **kw) * 0.01,
        torch.randn(LAYERS, h, i, **kw) * 0.01,
    )
    weight_bytes = sum(t.numel() * t.element_size() for t in (w.qkv, w.o, w.gate_up, w.down)) / LAYERS
    bandwidth = copy_bandwidth("cuda", 2.0)
    result: dict[str, Any] = {
        "unit": "microseconds per layer (graph replay over 24 layers / 24)",
        "copy_bandwidth_Bps": bandwidth,
        "weight_MB_per_layer": weight_bytes / 1e6,
        "floor_us": weight_bytes / bandwidth * 1e6,
        "rows": {},
    }
    for rows in (int(r) for r in args.rows.split(",")):
        x0 = torch.randn(rows, h, **kw)
        x = x0.clone()
        t = torch.empty(rows, 3 * h, **kw)
        gu = torch.empty(rows, 2 * i, **kw)

        def cublas(x: torch.Tensor = x, t: torch.Tensor = t, gu: torch.Tensor = gu) -> None:
            for layer in range(LAYERS):
                torch.matmul(x, w.qkv[layer].t(), out=t)
                x.addmm_(t[:, :h], w.o[layer].t())
                torch.matmul(x, w.gate_up[layer].t(), out=gu)
                x.addmm_(swiglu_fwd(gu[:, :i], gu[:, i:]), w.down[layer].t())

        x.copy_(x0)
        cublas()
        ref = x.float().clone()
        delta = float((ref - x0.float()).abs().max())  # errors relative to what the layers added
        row: dict[str, Any] = {"cublas": {"us": time_graph(cublas) / LAYERS}}
        for (tag, cfg), mode in itertools.product(configs.items(), modes):
            tag = f"{tag},p{mode}"
            run = functools.partial(
                run_chain, x, w, configs=dict.fromkeys(PHASES, cfg),
                prefetch=0 if mode == "i" else int(mode), idle_prefetch=mode == "i",
            )  # fmt: skip
            x.copy_(x0)
            buf = run()
            torch.cuda.synchronize()
            err = float((x.float() - ref).abs().max()) / delta
            if int(buf.error):  # a barrier gave up: programs were not all resident; do not time it
                row[f"chain[{tag}]"] = {"us": float("nan"), "max_rel_err": err, "barrier_error": 1}
                continue
            us = time_graph(run) / LAYERS
            row[f"chain[{tag}]"] = {"us": us, "max_rel_err": err, "barrier_error": int(buf.error.item())}
        tiny = ChainWeights(
            *(torch.randn(LAYERS, n, k, **kw) * 0.01 for n, k in ((192, 64), (64, 64), (128, 64), (64, 64)))
        )
        xt = torch.randn(rows, 64, **kw)
        for tag, cfg in configs.items():
            run = functools.partial(run_chain, xt, tiny, configs=dict.fromkeys(PHASES, cfg))
            if not int(run().error):
                row[f"barriers[{tag}]"] = {"us": time_graph(run) / LAYERS}
        row |= block_ab(x0, w, kw)
        for name, entry in row.items():
            if not name.startswith(("barriers", "block")):
                entry["weight_TBps"] = weight_bytes / (entry["us"] * 1e-6) / 1e12
        result["rows"][rows] = row
        print(rows, {k: round(v["us"], 2) for k, v in row.items()}, flush=True)
    print("wrote", write_result(args.out or f"gpu_decode_chain_{card()}.json", result))


if __name__ == "__main__":
    main()
