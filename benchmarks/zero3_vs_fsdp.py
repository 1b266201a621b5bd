"""DDP vs megalith ZeRO-2 vs megalith ZeRO-3 vs FSDP2 (FSDPPlugin), on 2 gloo ranks (CPU).

    uv run python benchmarks/zero3_vs_fsdp.py                 # all configurations, ~17M-param Llama
    uv run python benchmarks/zero3_vs_fsdp.py --steps 3 --configs zero3,fsdp2

Each configuration runs in a fresh torchrun launch, so per-rank peak RSS is its own. Reported:
median step time (forward + backward + step), per-rank peak RSS, and rank 0's measured
model-state bytes against the ZeRO paper's formula for fp32 AdamW (DDP 16Ψ, ZeRO-2 4Ψ+12Ψ/N,
ZeRO-3 and FSDP2 16Ψ/N). Both ZeRO-3 and FSDP2 shard the same module groups (`--group-mb`).
Writes benchmarks/results/zero3_vs_fsdp_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONFIGS = ["ddp", "zero2", "zero3", "fsdp2"]
FORMULA = {"ddp": (16, 0), "zero2": (4, 12), "zero3": (0, 16), "fsdp2": (0, 16)}


def model_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=8192,
        hidden_size=384,
        intermediate_size=1024,
        num_hidden_layers=6,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=256,
        attn_implementation="sdpa",
    )


def build(config: str, group_mb: float):
    import torch
    from transformers import LlamaForCausalLM

    from megalith.booster import Booster
    from megalith.booster.plugins import DDPPlugin, FSDPPlugin, ZeroPlugin

    torch.manual_seed(0)
    model = LlamaForCausalLM(model_config())
    plugin = {
        "ddp": lambda: DDPPlugin(),
        "zero2": lambda: ZeroPlugin(stage=2),
        "zero3": lambda: ZeroPlugin(stage=3, bucket_size_mb=group_mb),
        "fsdp2": lambda: FSDPPlugin(group_size_mb=group_mb),
    }[config]()
    booster = Booster(plugin)
    model, opt, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    return model, opt, booster


def state_bytes(model, opt) -> int:
    measured = opt.memory_bytes() if hasattr(opt, "memory_bytes") else None
    if measured is not None and "params" in measured:  # ZeRO-3 reports its parameter shards itself
        return sum(measured.values())
    params = 0
    for p in model.parameters():
        t = p.to_local() if hasattr(p, "to_local") else p
        params += t.numel() * t.element_size()
    if measured is not None:
        return params + measured["grads"] + measured["optimizer_states"]
    import torch

    grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
    states = sum(
        t.numel() * t.element_size()
        for s in opt.optim.state.values()
        for t in s.values()
        if isinstance(t, torch.Tensor) and t.numel() > 1
    )
    return params + grads + states


def worker(config: str, steps: int, group_mb: float, out: str) -> None:
    import torch
    import torch.distributed as dist

    from megalith.distributed import launch

    info = launch(device="cpu")
    model, opt, booster = build(config, group_mb)
    g = torch.Generator().manual_seed(info.rank)
    times, states = [], 0
    for step in range(steps + 2):
        ids = torch.randint(0, model_config().vocab_size, (4, 256), generator=g)
        dist.barrier()
        t0 = time.perf_counter()
        booster.backward(model(input_ids=ids, labels=ids).loss, opt)
        if step == steps + 1:
            states = state_bytes(model, opt)  # gradients are live between backward and zero_grad
        opt.step()
        opt.zero_grad()
        dist.barrier()
        if step >= 2:
            times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    peaks = [None] * info.world_size
    dist.all_gather_object(peaks, peak)
    if info.rank == 0:
        Path(out).write_text(
            json.dumps({"step_s": statistics.median(times), "peak_rss_bytes": peaks, "states": states})
        )
    dist.destroy_process_group()


def run_config(config: str, args: argparse.Namespace, psi: int) -> dict:
    from megalith.common.utils import free_loopback_port

    world = args.nproc_per_node
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "r.json")
        cmd = [
            sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world}",
            "--master-addr=127.0.0.1", f"--master-port={free_loopback_port()}", __file__,
            "--worker", config, "--steps", str(args.steps), "--group-mb", str(args.group_mb), "--out", out,
        ]  # fmt: skip
        env = dict(os.environ, OMP_NUM_THREADS=str(max(1, len(os.sched_getaffinity(0)) // world)))
        subprocess.run(cmd, check=True, env=env)
        result = json.loads(Path(out).read_text())
    full, sharded = FORMULA[config]
    result["formula_model_state_bytes"] = int((full + sharded / world) * psi)
    result["measured_vs_formula"] = result["states"] / result["formula_model_state_bytes"]
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated subset of {CONFIGS}")
    p.add_argument("--steps", type=int, default=5, help="timed steps per configuration (after 2 warm-up)")
    p.add_argument("--nproc-per-node", type=int, default=2, help="ranks (default 2)")
    p.add_argument("--group-mb", type=float, default=4.0, help="ZeRO-3 / FSDP2 module-group size bound (MB)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.worker, args.steps, args.group_mb, args.out)
        return
    import torch
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        psi = sum(t.numel() for t in LlamaForCausalLM(model_config()).parameters())
    results = {c: run_config(c, args, psi) for c in args.configs.split(",")}
    ddp = results.get("ddp", {}).get("step_s")
    print(
        f"\nΨ = {psi / 1e6:.1f}M params, fp32 AdamW, 4x256 tokens per rank, {args.nproc_per_node} gloo ranks"
    )
    print(
        f"{'config':8s} {'step s':>8s} {'vs DDP':>7s} {'peak RSS GiB':>13s} {'states GiB':>11s} {'vs formula':>10s}"
    )
    for name, r in results.items():
        rel = f"{r['step_s'] / ddp:.2f}x" if ddp else "-"
        print(
            f"{name:8s} {r['step_s']:8.3f} {rel:>7s} {max(r['peak_rss_bytes']) / 2**30:13.2f} "
            f"{r['states'] / 2**30:11.3f} {r['measured_vs_formula']:10.3f}"
        )
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _common import write_result

    payload = {
        "num_params": psi,
        "tokens_per_rank": 4 * 256,
        "ranks": args.nproc_per_node,
        "results": results,
    }
    print(f"wrote {write_result('zero3_vs_fsdp_cpu.json', payload)}")


if __name__ == "__main__":
    main()
