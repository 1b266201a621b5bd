"""DDP vs megalith ZeRO-1/2 vs torch ZeroRedundancyOptimizer vs FSDP2, on 2 gloo ranks (CPU).

    uv run python benchmarks/zero_vs_ddp.py                # all configurations, ~17M-param Llama
    uv run python benchmarks/zero_vs_ddp.py --steps 3 --configs ddp,zero2

Each configuration runs in a fresh 2-process torchrun launch so per-rank peak RSS is its own.
Reported per configuration: median step time, per-rank peak RSS, measured model-state bytes
(params + grads + optimizer states on rank 0) and the formula's figure for fp32 AdamW
(DDP 16Ψ, ZeRO-1 8Ψ+8Ψ/N, ZeRO-2 4Ψ+12Ψ/N). Writes benchmarks/results/zero_vs_ddp_cpu.json.
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

CONFIGS = ["ddp", "zero1", "zero2", "zero2_no_overlap", "torch_zero_redundancy", "fsdp2"]
FORMULA = {
    "ddp": (16, 0),
    "zero1": (8, 8),
    "zero2": (4, 12),
    "zero2_no_overlap": (4, 12),
    "torch_zero_redundancy": (8, 8),
    "fsdp2": (0, 16),  # fully_shard keeps sharded params (ZeRO-3-like); the unsharded copy is transient
}


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


def local_bytes(t) -> int:
    if hasattr(t, "to_local"):
        t = t.to_local()
    return t.numel() * t.element_size()


def build(config: str):
    import torch
    from transformers import LlamaForCausalLM

    from megalith.booster import Booster
    from megalith.booster.plugins import DDPPlugin, ZeroPlugin

    torch.manual_seed(0)
    model = LlamaForCausalLM(model_config())
    if config in ("ddp", "zero1", "zero2", "zero2_no_overlap"):
        plugin = (
            DDPPlugin()
            if config == "ddp"
            else ZeroPlugin(
                stage=1 if config == "zero1" else 2, overlap_communication=config != "zero2_no_overlap"
            )
        )
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        booster = Booster(plugin)
        model, opt, *_ = booster.boost(model, opt)
        return model, opt, lambda loss: booster.backward(loss, opt)
    if config == "torch_zero_redundancy":
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model)
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-4)
        return model, opt, lambda loss: loss.backward()
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))  # CPU even where CUDA exists
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, opt, lambda loss: loss.backward()


def model_state_bytes(model, opt) -> dict[str, int]:
    import torch

    inner = getattr(opt, "optim", opt)
    params = {id(p): local_bytes(p) for p in model.parameters()}
    if hasattr(opt, "memory_bytes"):
        measured = opt.memory_bytes()
        grads, states = measured["grads"], measured["optimizer_states"]
    else:
        grads = sum(local_bytes(p.grad) for p in model.parameters() if p.grad is not None)
        states = sum(
            local_bytes(t)
            for s in inner.state.values()
            for t in s.values()
            if isinstance(t, torch.Tensor) and t.numel() > 1
        )
    return {"params": sum(params.values()), "grads": grads, "optimizer_states": states}


def worker(config: str, steps: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    from megalith.distributed import launch

    info = launch(device="cpu")
    model, opt, backward = build(config)
    vocab = model_config().vocab_size
    g = torch.Generator().manual_seed(info.rank)
    times, states = [], {}
    for step in range(steps + 2):
        ids = torch.randint(0, vocab, (4, 256), generator=g)
        dist.barrier()
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        backward(loss)
        if step == steps + 1:
            states = model_state_bytes(model, opt)  # grads are live between backward and zero_grad
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
            json.dumps(
                {
                    "step_s": statistics.median(times),
                    "peak_rss_bytes": peaks,
                    "model_states": states,
                    "world_size": info.world_size,
                }
            )
        )
    dist.destroy_process_group()


def run_config(config: str, steps: int, psi: int, world: int) -> dict:
    from megalith.common.utils import free_loopback_port

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "r.json")
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={world}",
            "--master-addr=127.0.0.1",
            f"--master-port={free_loopback_port()}",
            __file__,
            "--worker",
            config,
            "--steps",
            str(steps),
            "--out",
            out,
        ]
        subprocess.run(
            cmd,
            check=True,
            env=dict(os.environ, OMP_NUM_THREADS=str(max(1, len(os.sched_getaffinity(0)) // world))),
        )
        result = json.loads(Path(out).read_text())
    full, sharded = FORMULA[config]
    result["formula_model_state_bytes"] = int((full + sharded / world) * psi)
    measured = sum(result["model_states"].values())
    result["measured_model_state_bytes"] = measured
    result["measured_vs_formula"] = measured / result["formula_model_state_bytes"]
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated subset of {CONFIGS}")
    p.add_argument("--steps", type=int, default=6, help="timed steps per configuration (after 2 warm-up)")
    p.add_argument("--nproc-per-node", type=int, default=2, help="ranks (default 2)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.worker, args.steps, args.out)
        return
    import torch
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        psi = sum(t.numel() for t in LlamaForCausalLM(model_config()).parameters())
    results = {}
    for config in args.configs.split(","):
        results[config] = run_config(config, args.steps, psi, args.nproc_per_node)
    ddp = results.get("ddp", {}).get("step_s")
    print(
        f"\nΨ = {psi / 1e6:.1f}M params, fp32 AdamW, 4x256 tokens per rank, {args.nproc_per_node} gloo ranks"
    )
    print(
        f"{'config':24s} {'step s':>8s} {'vs DDP':>7s} {'peak RSS GiB':>13s} {'states GiB':>11s} {'vs formula':>10s}"
    )
    for name, r in results.items():
        rel = f"{r['step_s'] / ddp:.2f}x" if ddp else "-"
        print(
            f"{name:24s} {r['step_s']:8.3f} {rel:>7s} {max(r['peak_rss_bytes']) / 2**30:13.2f} "
            f"{r['measured_model_state_bytes'] / 2**30:11.3f} {r['measured_vs_formula']:10.3f}"
        )
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _common import write_result

    path = write_result(
        "zero_vs_ddp_cpu.json",
        {"num_params": psi, "tokens_per_rank": 4 * 256, "ranks": args.nproc_per_node, "results": results},
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
