"""Measured step time of each pipeline schedule on CPU with gloo: pp=2 × dp=2 (4 ranks).

    uv run python benchmarks/pp_measure.py              # prints the table
    uv run python benchmarks/pp_measure.py --steps 3

`measured_rows()` is what `benchmarks/pp_schedules.py` records next to the simulated bubble ratios:
one row per schedule with the median step time (forward + backward of m microbatches through
`booster.execute_pipeline`, the dp gradient reduction and an AdamW step) after one warm-up step.
Each rank runs one torch thread, so on a machine with fewer than 4 free cores the ranks share
cores and the times include that contention (the simulated part is the clean comparison).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zb-v", 2))
PP, DP = 2, 2


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=5, help="timed steps per schedule (after 1 warm-up step)")
    p.add_argument("--microbatches", type=int, default=8, help="microbatches per step (a multiple of pp=2)")
    p.add_argument("--micro-batch-size", type=int, default=2, help="sequences per microbatch")
    p.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    p.add_argument("--hidden", type=int, default=128, help="hidden size of the Llama model")
    p.add_argument("--layers", type=int, default=8, help="decoder layers (>= 4: interleaved uses 4 stages)")
    p.add_argument("--worker", default="", help="internal: file where rank 0 of the 4-rank run writes rows")
    return p.parse_args(argv)


def _model(args: argparse.Namespace) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=1024,
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=args.seq,
        attn_implementation="eager",
    )
    return LlamaForCausalLM(config)


def _time_schedule(args: argparse.Namespace, name: str, v: int) -> list[float]:
    import torch

    from megalith.booster import Booster
    from megalith.booster.plugins import HybridPlugin

    plugin = HybridPlugin(
        pp_size=PP, pp_schedule=name, num_microbatches=args.microbatches, num_model_chunks=v
    )
    booster = Booster(plugin)
    model = _model(args)
    model, opt, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    gen = torch.Generator().manual_seed(plugin.dp_rank())
    rows = args.microbatches * args.micro_batch_size
    times = []
    for _ in range(args.steps + 1):
        ids = torch.randint(0, 1024, (rows, args.seq), generator=gen)
        t0 = time.perf_counter()
        booster.execute_pipeline(iter([{"input_ids": ids}]), model, None, opt)
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
    return times[1:]


def _worker(args: argparse.Namespace) -> None:
    import torch

    from megalith.distributed import launch, rank, shutdown

    torch.set_num_threads(1)
    launch(device="cpu")
    rows = []
    for name, v in SCHEDULES:
        times = _time_schedule(args, name, v)
        rows.append(
            {
                "schedule": name,
                "p": PP,
                "dp": DP,
                "m": args.microbatches,
                "v": v,
                "micro_batch_size": args.micro_batch_size,
                "seq": args.seq,
                "hidden": args.hidden,
                "layers": args.layers,
                "step_time_s": statistics.median(times),
                "steps": len(times),
            }
        )
    if rank() == 0:
        Path(args.worker).write_text(json.dumps(rows))
    shutdown()


def measured_rows(args: argparse.Namespace | None = None, steps: int | None = None) -> list[dict[str, Any]]:
    """Median step time per schedule at pp=2 × dp=2 on 4 gloo ranks (a `torch.distributed.run`
    child process). `args` may be any namespace with `steps` (pp_schedules.py passes its own)."""
    from megalith.common.utils import free_loopback_port

    ours = args if args is not None and hasattr(args, "microbatches") else parse_args([])
    ours.steps = steps if steps is not None else getattr(args, "steps", ours.steps)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={PP * DP}",
            "--nnodes=1",
            "--master-addr=127.0.0.1",
            f"--master-port={free_loopback_port()}",
            str(Path(__file__).resolve()),
            *_argv(ours),
            "--worker",
            str(out),
        ]
        code = subprocess.run(cmd, check=False).returncode
        if code != 0 or not out.exists():
            raise SystemExit(f"the 4-rank pipeline run failed (exit code {code})")
        return list(json.loads(out.read_text()))


def _argv(args: argparse.Namespace) -> list[str]:
    return [
        f"--steps={args.steps}",
        f"--microbatches={args.microbatches}",
        f"--micro-batch-size={args.micro_batch_size}",
        f"--seq={args.seq}",
        f"--hidden={args.hidden}",
        f"--layers={args.layers}",
    ]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        _worker(args)
        return
    rows = measured_rows(args)
    print(f"{'schedule':12s} {'p':>2s} {'dp':>2s} {'m':>3s} {'v':>2s} {'step':>9s}")
    for r in rows:
        print(
            f"{r['schedule']:12s} {r['p']:2d} {r['dp']:2d} {r['m']:3d} {r['v']:2d} {r['step_time_s']:8.3f}s"
        )


if __name__ == "__main__":
    main()
