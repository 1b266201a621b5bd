"""Training throughput of `llama-pretrain train` under DDP vs ZeRO-2 on 2 CPU ranks.

    uv run python benchmarks/llama_train_cpu.py                     # SmolLM2-135M, 6 steps per plugin
    uv run python benchmarks/llama_train_cpu.py --model tiny --steps 20 --plugins ddp,zero1,zero2

Each plugin is a fresh `llama-pretrain train` run; tokens/s is the steady-state rate from
metrics.jsonl (steps after the first, which pays one-time costs). Writes
benchmarks/results/llama_train_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write_result


def run(plugin: str, args: argparse.Namespace, tmp: Path) -> dict:
    out = tmp / plugin
    cmd = [
        sys.executable,
        "-m",
        "megalith_llama.cli",
        "train",
        "--plugin",
        plugin,
        "--model",
        args.model,
        "--nproc-per-node",
        str(args.nproc),
        "--max-steps",
        str(args.steps),
        "--save-every",
        str(10**6),
        "--seq-len",
        str(args.seq_len),
        "--batch-size",
        str(args.batch_size),
        "--eval-batches",
        "1",
        "--output",
        str(out),
        "--device",
        "cpu",
    ]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    # tokens_per_s in the metrics is cumulative since the loop started; use the per-step deltas.
    times = [b["time"] - a["time"] for a, b in zip(steps, steps[1:], strict=False)]
    tokens = sum(r["tokens"] for r in steps[1:])
    return {
        "tokens_per_s": tokens / sum(times),
        "step_s": sum(times) / len(times),
        "mfu": steps[-1]["mfu"],
        "final_loss": steps[-1]["loss"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="model for `train --model` (default smollm2)")
    p.add_argument("--plugins", default="ddp,zero2", help="comma-separated plugins (default ddp,zero2)")
    p.add_argument("--steps", type=int, default=6, help="optimizer steps per run (default 6)")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per sequence (default 256)")
    p.add_argument("--batch-size", type=int, default=2, help="sequences per rank per step (default 2)")
    p.add_argument("--nproc", type=int, default=2, help="ranks (default 2)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = {plugin: run(plugin, args, Path(tmp)) for plugin in args.plugins.split(",")}
    print(f"{'plugin':8s} {'tokens/s':>10s} {'step s':>8s} {'MFU':>6s}")
    for name, r in results.items():
        print(f"{name:8s} {r['tokens_per_s']:10.1f} {r['step_s']:8.2f} {r['mfu'] or 0:6.3f}")
    path = write_result("llama_train_cpu.json", {"config": vars(args), "results": results})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
