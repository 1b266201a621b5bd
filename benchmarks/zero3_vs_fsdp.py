"""DDP vs megalith ZeRO-2 vs megalith ZeRO-3 vs FSDP2 (FSDPPlugin), with and without CPU offload.

    uv run python benchmarks/zero3_vs_fsdp.py                 # CPU: 2 gloo ranks, ~17M-param Llama, fp32
    uv run python benchmarks/zero3_vs_fsdp.py --steps 3 --configs zero3,fsdp2
    python benchmarks/zero3_vs_fsdp.py --device cuda          # 1 GPU: ~1.1B Llama, bf16, 1-rank NCCL group

Each configuration runs in a fresh torchrun launch, so per-rank peaks are its own. Reported: median
step time (forward + backward + step; CUDA synchronised before each clock read), per-rank peak RSS,
on CUDA the peak `torch.cuda.max_memory_allocated` over the timed steps, and rank 0's measured
model-state bytes on the device and in host memory against `megalith.booster.plan()` (the ZeRO
paper's accounting: fp32 AdamW DDP 16Ψ, ZeRO-2 4Ψ+12Ψ/N, ZeRO-3 and FSDP2 16Ψ/N; offloaded
parts counted as host). ZeRO-3 and FSDP2 shard the same module groups (`--group-mb`).
`zero3_offload` = ZeroPlugin(stage=3, offload_optim_frac=f, offload_param_frac=f) with f =
`--offload-frac`; `fsdp2_offload` = FSDP2's CPUOffloadPolicy (pinned host memory on CUDA).
Writes benchmarks/results/zero3_vs_fsdp_{cpu,cuda}.json.
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

CONFIGS = ["ddp", "zero2", "zero3", "fsdp2", "zero3_offload", "fsdp2_offload"]
DEFAULTS = {  # per device: configs, model size, precision, batch, seq, group MB, ranks
    "cpu": {"configs": "ddp,zero2,zero3,fsdp2", "model": "17m", "precision": "fp32", "batch": 4, "seq": 256,
            "group_mb": 4.0, "nproc": 2},
    "cuda": {"configs": "zero3_offload,fsdp2_offload,zero3,fsdp2", "model": "1b", "precision": "bf16", "batch": 8,
             "seq": 1024, "group_mb": 150.0, "nproc": 1},
}  # fmt: skip


def model_config(size: str):
    from transformers import LlamaConfig

    if size == "1b":  # TinyLlama-1.1B's shape: 1.10e9 parameters
        dims = {"vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22,
                "num_attention_heads": 32, "num_key_value_heads": 4, "max_position_embeddings": 2048}  # fmt: skip
    else:
        dims = {"vocab_size": 8192, "hidden_size": 384, "intermediate_size": 1024, "num_hidden_layers": 6,
                "num_attention_heads": 6, "num_key_value_heads": 2, "max_position_embeddings": 256}  # fmt: skip
    return LlamaConfig(attn_implementation="sdpa", **dims)


def make_plugin(config: str, group_mb: float, offload_frac: float, precision: str):
    """`group_mb` is in MB of fp32 parameters: FSDP2 groups count 4-byte elements, ZeRO-3 counts
    bytes of the (possibly bf16) parameters, so ZeRO-3 gets the bound that means the same elements."""
    from megalith.booster.plugins import DDPPlugin, FSDPPlugin, ZeroPlugin

    f = offload_frac
    zero_mb = group_mb * (2 if precision == "bf16" else 4) / 4
    return {
        "ddp": lambda: DDPPlugin(),
        "zero2": lambda: ZeroPlugin(stage=2),
        "zero3": lambda: ZeroPlugin(stage=3, bucket_size_mb=zero_mb),
        "zero3_offload": lambda: ZeroPlugin(
            stage=3, bucket_size_mb=zero_mb, offload_optim_frac=f, offload_param_frac=f
        ),
        "fsdp2": lambda: FSDPPlugin(group_size_mb=group_mb),
        "fsdp2_offload": lambda: FSDPPlugin(group_size_mb=group_mb, cpu_offload=True),
    }[config]()


def build(args: argparse.Namespace, device, world: int):
    """The boosted model (built in fp32 on the host, moved to `device`) and the plan() of it."""
    import torch
    from transformers import LlamaForCausalLM

    from megalith.booster import Booster
    from megalith.booster.plan import plan

    torch.manual_seed(0)
    model = LlamaForCausalLM(model_config(args.model)).to(device)
    plugin = make_plugin(args.worker, args.group_mb, args.offload_frac, args.precision)
    expected = plan(model, plugin, world, args.precision)
    booster = Booster(plugin, precision=args.precision)
    model, opt, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return model, opt, booster, expected


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _bytes(t) -> tuple[str, int]:
    t = _local(t)
    return t.device.type, t.numel() * t.element_size()


def state_bytes(config: str, model, opt, device_type: str) -> dict[str, int]:
    """Rank-local model-state bytes: {"device": on `device_type`, "host": in host memory}.
    ZeRO reports its own (ZeRO-3 by placement); for DDP and FSDP2 the params, grads, optimizer
    states (not the scalar step) and separate fp32 masters are counted where their tensors live."""
    measured = opt.memory_bytes() if config.startswith("zero") else None
    if measured is not None and "params" in measured:
        host = measured.get("host", 0)
        return {"device": sum(measured.values()) - host, "host": host}
    params = list(model.parameters())
    if measured is not None:  # ZeRO-1/2: replicated params, its own grad / state buffers
        return {
            "device": sum(_bytes(p)[1] for p in params) + measured["grads"] + measured["optimizer_states"],
            "host": 0,
        }
    tensors = params + [p.grad for p in params if p.grad is not None]
    tensors += [
        t for s in opt.optim.state.values() for t in s.values() if hasattr(t, "numel") and t.numel() > 1
    ]
    param_ptrs = {_local(p).data_ptr() for p in params}
    tensors += [m for m in getattr(opt, "masters", []) if m.data_ptr() not in param_ptrs]
    out = {"device": 0, "host": 0}
    for t in tensors:
        kind, n = _bytes(t)
        out["device" if kind == device_type else "host"] += n
    return out


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _init(device_name: str):
    """Process group from the torchrun environment; also for one rank (FSDP2 needs a group)."""
    import torch
    import torch.distributed as dist

    from megalith.distributed import launch

    info = launch(device=device_name)
    device = info.device.torch
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    return info, device


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    info, device = _init(args.device)
    model, opt, booster, expected = build(args, device, info.world_size)
    g = torch.Generator().manual_seed(info.rank)
    vocab = model_config(args.model).vocab_size
    times, states = [], {}
    for step in range(args.steps + 2):
        ids = torch.randint(0, vocab, (args.batch, args.seq), generator=g).to(device, non_blocking=True)
        if step == 2 and device.type == "cuda":  # warm-up done: peaks from here on
            torch.cuda.reset_peak_memory_stats(device)
        _sync(device)
        dist.barrier()
        t0 = time.perf_counter()
        booster.backward(model(input_ids=ids, labels=ids).loss, opt)
        if step == args.steps + 1:
            states = state_bytes(args.worker, model, opt, device.type)  # gradients are live until zero_grad
        opt.step()
        opt.zero_grad()
        _sync(device)
        if step >= 2:
            times.append(time.perf_counter() - t0)
    report(info, device, times, states, expected, args.out)
    dist.destroy_process_group()


def report(info, device, times: list[float], states: dict[str, int], expected, out: str) -> None:
    import torch
    import torch.distributed as dist

    mine = {
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "peak_cuda_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
    }
    everyone: list = [None] * info.world_size
    dist.all_gather_object(everyone, mine)
    if info.rank == 0:
        result = {
            "step_s": statistics.median(times),
            "peak_rss_bytes": [e["peak_rss_bytes"] for e in everyone],
            "peak_cuda_bytes": [e["peak_cuda_bytes"] for e in everyone],
            "states": states["device"] + states["host"],
            "states_device": states["device"],
            "states_host": states["host"],
            "plan_device": expected.total,
            "plan_host": expected.host,
        }
        Path(out).write_text(json.dumps(result))


def run_config(config: str, args: argparse.Namespace) -> dict:
    from megalith.common.utils import free_loopback_port

    world = args.nproc_per_node
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "r.json")
        flags = ["--device", args.device, "--model", args.model, "--precision", args.precision,
                 "--batch", str(args.batch), "--seq", str(args.seq), "--steps", str(args.steps),
                 "--group-mb", str(args.group_mb), "--offload-frac", str(args.offload_frac)]  # fmt: skip
        cmd = [
            sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world}",
            "--master-addr=127.0.0.1", f"--master-port={free_loopback_port()}", __file__,
            "--worker", config, "--out", out, *flags,
        ]  # fmt: skip
        env = dict(os.environ, OMP_NUM_THREADS=str(max(1, len(os.sched_getaffinity(0)) // world)))
        subprocess.run(cmd, check=True, env=env)
        result = json.loads(Path(out).read_text())
    result["device_vs_plan"] = result["states_device"] / max(result["plan_device"], 1)
    result["host_vs_plan"] = result["states_host"] / result["plan_host"] if result["plan_host"] else None
    return result


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cpu (gloo ranks) or cuda (NCCL)")
    p.add_argument("--configs", help=f"comma-separated subset of {CONFIGS} (default depends on --device)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per configuration (after 2 warm-up)")
    p.add_argument("--nproc-per-node", type=int, help="ranks (default: 2 on cpu, 1 on cuda)")
    p.add_argument("--model", choices=["17m", "1b"], help="Llama size (default: 17m on cpu, 1b on cuda)")
    p.add_argument("--precision", choices=["fp32", "bf16"], help="default: fp32 on cpu, bf16 on cuda")
    p.add_argument("--batch", type=int, help="sequences per rank per step (default: 4 cpu, 8 cuda)")
    p.add_argument("--seq", type=int, help="tokens per sequence (default: 256 cpu, 1024 cuda)")
    p.add_argument(
        "--group-mb",
        type=float,
        help="ZeRO-3 / FSDP2 module-group bound in MB of fp32 params (4 cpu; 150 cuda: one group per 1B decoder layer)",
    )
    p.add_argument(
        "--offload-frac", type=float, default=1.0, help="zero3_offload: offloaded fraction (default 1)"
    )
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    defaults = DEFAULTS[args.device]
    for key, default in (("configs", "configs"), ("nproc_per_node", "nproc"), ("model", "model"),
                         ("precision", "precision"), ("batch", "batch"), ("seq", "seq"), ("group_mb", "group_mb")):  # fmt: skip
        if getattr(args, key) is None:
            setattr(args, key, defaults[default])
    return args


def main() -> None:
    args = parse_args()
    if args.worker:
        worker(args)
        return
    import torch
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        psi = sum(t.numel() for t in LlamaForCausalLM(model_config(args.model)).parameters())
    results = {}
    for config in args.configs.split(","):
        results[config] = run_config(config, args)
        print(f"{config}: {json.dumps(results[config])}", flush=True)  # kept if a later one is cut off
    print_table(args, psi, results)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _common import write_result

    payload = {
        "num_params": psi,
        "device": args.device,
        "precision": args.precision,
        "tokens_per_rank": args.batch * args.seq,
        "ranks": args.nproc_per_node,
        "offload_frac": args.offload_frac,
        "results": results,
    }
    print(f"wrote {write_result(f'zero3_vs_fsdp_{args.device}.json', payload)}")


def print_table(args: argparse.Namespace, psi: int, results: dict[str, dict]) -> None:
    gib = 2**30
    print(
        f"\nΨ = {psi / 1e6:.1f}M params, {args.precision} AdamW, {args.batch}x{args.seq} tokens per rank, "
        f"{args.nproc_per_node} {'NCCL' if args.device == 'cuda' else 'gloo'} rank(s)"
    )
    print(
        f"{'config':14s} {'step s':>8s} {'peak RSS GiB':>13s} {'peak CUDA GiB':>14s} {'dev states':>11s} "
        f"{'plan dev':>9s} {'ratio':>6s} {'host states':>12s} {'plan host':>10s}"
    )
    for name, r in results.items():
        cuda = max(r["peak_cuda_bytes"]) / gib if r["peak_cuda_bytes"][0] is not None else float("nan")
        print(
            f"{name:14s} {r['step_s']:8.3f} {max(r['peak_rss_bytes']) / gib:13.2f} {cuda:14.2f} "
            f"{r['states_device'] / gib:11.3f} {r['plan_device'] / gib:9.3f} {r['device_vs_plan']:6.3f} "
            f"{r['states_host'] / gib:12.3f} {r['plan_host'] / gib:10.3f}"
        )


if __name__ == "__main__":
    main()
