"""Separate vs concatenated projections of one TinyLlama layer, forward + backward.

Why `megalith.policies.attention` fuses q/k/v and why the MLP's gate/up pair is not fused the same way:
for each group of projections sharing an input (q/k/v: 2048, 256, 256 outputs; gate/up: 5632 each;
hidden 2048, 16384 tokens = the 8 × 2048 batch of `gpu_train.py`, bf16) this times

* ``separate``: one ``F.linear`` per projection, then backward of all of them;
* ``fused``: ``F.linear`` over ``torch.cat`` of the weights (the concatenation and the split of its
  gradient included), then backward;
* ``*_fwd``: the forward alone, without autograd.

Milliseconds per call: `triton.testing.do_bench` on a GPU; on CPU (`--device cpu`, tiny shapes,
a smoke test) the median wall clock of 20 calls.

    python benchmarks/gpu_qkv.py               # writes results/gpu_qkv_<card>.json (h200, h100, ...)
    python benchmarks/gpu_qkv.py --device cpu  # writes results/gpu_qkv_cpu.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import result_name, write_result

GROUPS = {"qkv": (2048, 256, 256), "gate_up": (5632, 5632)}  # TinyLlama-1.1B output widths
TOKENS, HIDDEN = 16384, 2048


def timer(device: torch.device) -> Callable[[Callable[[], Any]], float]:
    if device.type == "cuda":
        from triton.testing import do_bench

        return lambda fn: float(do_bench(fn, warmup=20, rep=200))

    def wall_ms(fn: Callable[[], Any]) -> float:
        fn()
        times = []
        for _ in range(20):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    return wall_ms


def measure(outs: tuple[int, ...], tokens: int, hidden: int, device: torch.device) -> dict[str, float]:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    x = torch.randn(tokens, hidden, device=device, dtype=dtype, requires_grad=True)
    ws = [(0.02 * torch.randn(n, hidden, device=device, dtype=dtype)).requires_grad_() for n in outs]
    grads = [torch.randn(tokens, n, device=device, dtype=dtype) for n in outs]
    grad_cat = torch.cat(grads, dim=-1)

    def separate() -> None:
        torch.autograd.backward([F.linear(x, w) for w in ws], grads)

    def fused() -> None:
        F.linear(x, torch.cat(ws)).backward(grad_cat)

    def separate_fwd() -> None:
        with torch.no_grad():
            [F.linear(x, w) for w in ws]

    def fused_fwd() -> None:
        with torch.no_grad():
            F.linear(x, torch.cat(ws))

    bench = timer(device)
    row = {}
    for name, fn in (
        ("separate", separate),
        ("fused", fused),
        ("separate_fwd", separate_fwd),
        ("fused_fwd", fused_fwd),
    ):
        row[f"{name}_ms"] = bench(fn)
        x.grad = None
        for w in ws:
            w.grad = None
    row["speedup"] = row["separate_ms"] / row["fused_ms"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cuda or cpu"
    )
    parser.add_argument(
        "--out", default=None, help="results file name (default gpu_qkv_<card: h200, h100, ...|cpu>.json)"
    )
    args = parser.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    tokens, hidden, scale = (TOKENS, HIDDEN, 1) if cuda else (256, 64, 32)
    groups = {name: tuple(n // scale for n in outs) for name, outs in GROUPS.items()}
    rows = {name: measure(outs, tokens, hidden, device) for name, outs in groups.items()}
    for name, row in rows.items():
        print(name, {k: round(v, 4) for k, v in row.items()}, flush=True)
    out = args.out or result_name("gpu_qkv", device.type)
    path = write_result(out, {"tokens": tokens, "hidden": hidden, "outputs": groups, "groups": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
