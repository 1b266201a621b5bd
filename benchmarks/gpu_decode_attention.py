"""Launch configurations of the fast engine's decode attention, swept as the decode step runs it.

The kernel's defaults (:mod:`megalith_chat.engine.fast_attention`) came from a sweep over repeated
calls on one layer's cache, which the L2 cache partly holds. Inside the decode step every layer
reads its own cache from DRAM, so this sweep captures one call per layer for 24 layers of distinct
caches (0.37B generation shape: 16 heads of 64; 128-token prompts, the slot at 255, the mean
context of 256 new tokens) in a CUDA graph and times its replay: microseconds per layer, and the
bandwidth that is (bytes of the valid K/V slots / time).

    python benchmarks/gpu_decode_attention.py      # -> results/gpu_decode_attention_<card>.json (h200, h100, ...)
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import card, write_result
from gpu_decode_gemm import time_graph

LAYERS, HEADS, DIM, SLOT, CACHE = 24, 16, 64, 255, 384


def sweep(
    rows: int, blocks: list[int], warps: list[int], stages: list[int], targets: list[int]
) -> list[dict[str, Any]]:
    import torch

    from megalith_chat.engine.fast_attention import decode_attention

    kw: dict[str, Any] = {"device": "cuda", "dtype": torch.bfloat16}
    kv_len = 256  # slots read: the slot rounded up to the engine's 64-slot bucket
    caches = [
        (torch.randn(rows, HEADS, CACHE, DIM, **kw), torch.randn(rows, HEADS, CACHE, DIM, **kw))
        for _ in range(LAYERS)
    ]
    q = torch.randn(rows, HEADS, 1, DIM, **kw)
    start = torch.zeros(rows, dtype=torch.long, device="cuda")
    slot = torch.tensor(SLOT, device="cuda")
    valid_bytes = rows * HEADS * (SLOT + 1) * DIM * 2 * 2
    out = []
    for block, warp, stage, target in itertools.product(blocks, warps, stages, targets):
        launch = {"num_warps": warp, "num_stages": stage}

        def step(block: int = block, launch: dict[str, int] = launch, target: int = target) -> None:
            for k, v in caches:
                decode_attention(q, k[:, :, :kv_len], v[:, :, :kv_len], start, slot, 0.125,
                                 target_programs=target, block_n=block, launch=launch)  # fmt: skip

        try:
            us = time_graph(step, reps=20) / LAYERS
        except Exception as exc:  # noqa: BLE001  (a configuration the compiler rejects is a result)
            out.append({"block_n": block, **launch, "target_programs": target, "error": repr(exc)[:200]})
            continue
        out.append(
            {"block_n": block, **launch, "target_programs": target, "us": us, "TBps": valid_bytes / us / 1e6}
        )
        print(rows, out[-1], flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="64,256", help="comma-separated batch sizes (default: 64,256)")
    p.add_argument("--blocks", default="32,64,128", help="keys per loop step to try (default: 32,64,128)")
    p.add_argument("--warps", default="2,4,8", help="num_warps values to try (default: 2,4,8)")
    p.add_argument("--stages", default="2,3,4", help="num_stages values to try (default: 2,3,4)")
    p.add_argument("--targets", default="512,2048", help="target_programs values to try (default: 512,2048)")
    p.add_argument(
        "--out",
        default=None,
        help="result file (under benchmarks/results/ unless a path; default gpu_decode_attention_<card>.json)",
    )
    args = p.parse_args()

    def ints(text: str) -> list[int]:
        return [int(x) for x in text.split(",")]

    result: dict[str, Any] = {
        "unit": "microseconds per layer, graph-replayed over 24 layers of distinct caches",
        "rows": {},
    }
    for rows in ints(args.rows):
        runs = sweep(rows, ints(args.blocks), ints(args.warps), ints(args.stages), ints(args.targets))
        timed = [r for r in runs if "us" in r]
        result["rows"][rows] = {"best": min(timed, key=lambda r: r["us"]) if timed else None, "runs": runs}
        print(rows, "best", result["rows"][rows]["best"], flush=True)
    print("wrote", write_result(args.out or f"gpu_decode_attention_{card()}.json", result))


if __name__ == "__main__":
    main()
