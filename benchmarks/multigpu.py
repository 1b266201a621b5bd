"""Multi-GPU runs on one host: NCCL equivalence, weak scaling, TP/PP step times, weight-sync bandwidth.

    python3 benchmarks/multigpu.py                        # every section on all visible GPUs
    python3 benchmarks/multigpu.py --sections equiv,sync  # a subset
    uv run python benchmarks/multigpu.py --device cpu --nproc 4 --tiny   # gloo smoke run on CPU

Each section runs in fresh `torch.distributed.run` launches (127.0.0.1) and appends to
benchmarks/results/multigpu_<kind>.json (kind = "nvidia-h200-x<N>" on GPUs, "cpu-x<N>" on CPU):

- equiv: 3 training steps of a small Llama in bf16 (fp32 masters) under DDP, ZeRO-1/2/3, FSDP2,
  tp=2/4 (+ both SP modes), pp=2/4 with every schedule and the dp×tp×pp hybrid, each compared with
  a single-device fp32 run of the same global batch on rank 0. Tolerances (bf16 compute):
  |loss − ref| ≤ 2e-2·|ref| per step and max |param − ref| ≤ 2e-2 (params are O(0.02–1)); on CPU
  (fp32, gloo) 1e-5 and 1e-5 — the same bounds as the pytest suite.
- scaling: ZeRO-2 and ZeRO-3 weak scaling on the TinyLlama-1.1B shape from 1 to N GPUs, batch 4×2048
  per GPU: tokens/s per GPU, efficiency = (tokens/s per GPU at n) / (at 1), per-GPU peak memory vs
  `plan()` (goal ≥ 90 % efficiency at the largest n).
- tp: step time at tp=1/2/4 and the communication share (time in tp collectives / step time,
  from the comm counter's byte count at the measured all-reduce bandwidth).
- pp: measured step time per schedule (pp=2/4) next to the simulator's bubble ratio.
- sync: NCCL broadcast of the 1.1B model's bf16 weights from rank 0 (the producer's GPU in a GRPO
  run) to the other ranks in 256 MiB buckets: seconds per GB.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write_result

SECTIONS = ["equiv", "scaling", "tp", "pp", "sync"]
EQUIV_CONFIGS = ["ddp", "zero1", "zero2", "zero3", "fsdp2", "tp2", "tp2-sg", "tp2-a2a", "tp4"]
PP_SCHEDULES = ["gpipe", "1f1b", "interleaved", "zb-h1"]
NCCL_SAFE_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


# ---------------------------------------------------------------------------------------------- models
def llama_config(shape: str):
    from transformers import LlamaConfig

    shapes = {
        "tiny": dict(hidden_size=64, intermediate_size=176, num_hidden_layers=4, num_attention_heads=8,
                     num_key_value_heads=4, vocab_size=256),
        "small": dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
                      num_key_value_heads=4, vocab_size=4096),
        "1.1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                     num_key_value_heads=4, vocab_size=32000),
    }  # fmt: skip
    return LlamaConfig(max_position_embeddings=4096, attn_implementation="sdpa", **shapes[shape])


def build_plugin(name: str, world: int):
    from megalith.booster.plugins import DDPPlugin, FSDPPlugin, HybridPlugin, ZeroPlugin

    if name.startswith("pp"):  # "pp2:1f1b" → pipeline of 2 stages, the rest of the world is dp
        size, schedule = name[2:].split(":")
        chunks = 2 if schedule == "interleaved" else 1
        return HybridPlugin(pp_size=int(size), pp_schedule=schedule, num_microbatches=2 * int(size),
                            num_model_chunks=chunks)  # fmt: skip
    if name == "hybrid":  # dp × tp × pp over every rank (needs 8)
        return HybridPlugin(tp_size=2, pp_size=2, pp_schedule="1f1b", num_microbatches=4, zero_stage=1)
    if name.startswith("tp"):
        size, _, mode = name[2:].partition("-")
        sp = {"": "none", "sg": "split_gather", "a2a": "all_to_all"}[mode]
        return HybridPlugin(tp_size=int(size), sp_mode=sp, zero_stage=2 if world > int(size) else 0)
    return {
        "ddp": DDPPlugin,
        "zero1": lambda: ZeroPlugin(stage=1),
        "zero2": lambda: ZeroPlugin(stage=2),
        "zero3": lambda: ZeroPlugin(stage=3, bucket_size_mb=4),
        "fsdp2": lambda: FSDPPlugin(group_size_mb=4),
    }[name]()


def usable(name: str, world: int) -> bool:
    if name == "hybrid":
        return world % 8 == 0
    if name.startswith(("tp", "pp")):
        size = int(name[2:].split("-")[0].split(":")[0])
        return world % size == 0 and world >= size
    return world >= 2


# --------------------------------------------------------------------------------------------- workers
def rank() -> int:
    from megalith.distributed import rank as _rank

    return _rank()


def world_size() -> int:
    from megalith.distributed import world_size as _world_size

    return _world_size()


def barrier() -> None:
    from megalith.distributed import barrier as _barrier

    _barrier()


def _batches(cfg, steps: int, batch: int, seq: int):
    import torch

    g = torch.Generator().manual_seed(1234)
    return [torch.randint(0, cfg.vocab_size, (batch, seq), generator=g) for _ in range(steps)]


def _reference(cfg, batches, device) -> tuple[list[float], dict]:
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    losses = []
    for ids in batches:
        ids = ids.to(device)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().float().cpu() for k, v in model.state_dict().items()}


def _train_under(name: str, cfg, batches, precision: str, device) -> tuple[list[float], dict]:
    import torch
    import torch.distributed as dist
    from transformers import LlamaForCausalLM

    from megalith.booster import Booster

    plugin = build_plugin(name, world_size())
    booster = Booster(plugin, precision=precision)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    model, opt, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1))
    per = batches[0].shape[0] // plugin.dp_size()
    lo = plugin.dp_rank() * per
    losses = []
    for ids in batches:
        ids = ids[lo : lo + per].to(device)
        if name.startswith(("pp", "hybrid")):
            out = booster.execute_pipeline(iter([ids]), model, None, opt, return_loss=True)
            loss = out["loss"].detach().clone()
        else:
            loss = model(input_ids=ids, labels=ids).loss
            booster.backward(loss, opt)
            loss = loss.detach().clone()
        opt.clip_grad_by_norm(1.0)
        opt.step()
        opt.zero_grad()
        if dist.is_initialized():
            dist.all_reduce(loss, group=plugin.dp_group)
        losses.append(loss.item() / plugin.dp_size())
    state = {k: v.detach().float().cpu() for k, v in plugin.export_state(model)}
    return losses, state


def worker_equiv(args: argparse.Namespace) -> dict:
    import torch

    cuda = args.device == "cuda"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    cfg = llama_config("tiny" if args.tiny else "small")
    batches = _batches(cfg, 3, 16, 64 if args.tiny else 256)
    precision = "bf16" if cuda else "fp32"
    tol = 2e-2 if cuda else 1e-5
    ref_losses, ref = _reference(cfg, batches, device) if rank() == 0 else ([], {})
    rows = []
    for name in args.configs:
        losses, state = _train_under(name, cfg, batches, precision, device)
        if rank() == 0:
            loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True))
            param_err = max((state[k] - ref[k]).abs().max().item() for k in ref if k in state)
            missing = sorted(set(ref) - set(state))
            ok = loss_err <= tol and param_err <= tol and not missing
            rows.append({"config": name, "max_rel_loss_err": loss_err, "max_abs_param_err": param_err,
                         "missing": missing, "tolerance": tol, "pass": ok})  # fmt: skip
            print(
                f"[equiv] {name:>14}: loss err {loss_err:.2e}  param err {param_err:.2e}  {'PASS' if ok else 'FAIL'}"
            )
        barrier()
    return {"precision": precision, "rows": rows}


def _timed_steps(booster, model, opt, ids, steps: int, warmup: int = 2) -> float:
    import torch

    times = []
    for i in range(warmup + steps):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        booster.backward(model(input_ids=ids, labels=ids).loss, opt)
        opt.step()
        opt.zero_grad()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def worker_scaling(args: argparse.Namespace) -> dict:
    import torch
    from transformers import LlamaForCausalLM

    from megalith.booster import Booster, plan
    from megalith.booster.plugins import ZeroPlugin

    cfg = llama_config("tiny" if args.tiny else "1.1b")
    batch, seq = (2, 64) if args.tiny else (4, 2048)
    world = world_size()
    rows = []
    for stage in (2, 3):
        plugin = ZeroPlugin(stage=stage)
        booster = Booster(plugin, precision="bf16" if args.device == "cuda" else "fp32")
        torch.manual_seed(0)
        with torch.device("meta"):
            planned = plan(LlamaForCausalLM(cfg), plugin, world_size=world, precision=booster.precision.name)
        model = LlamaForCausalLM(cfg)
        model, opt, *_ = booster.boost(
            model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=args.device == "cuda")
        )
        ids = torch.randint(0, cfg.vocab_size, (batch, seq), device=next(model.parameters()).device)
        if args.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        step_s = _timed_steps(booster, model, opt, ids, args.steps)
        peak = torch.cuda.max_memory_allocated() if args.device == "cuda" else None
        rows.append({"stage": stage, "world": world, "step_s": step_s, "tokens_per_s_per_gpu": batch * seq / step_s,
                     "peak_mem_GiB": peak / 2**30 if peak else None, "plan_GiB": planned.total / 2**30})  # fmt: skip
        del model, opt, booster
        if args.device == "cuda":
            torch.cuda.empty_cache()
    return {"rows": rows}


def _nccl_share(booster, model, opt, ids) -> float:
    """Fraction of one step's GPU kernel time spent in NCCL kernels (torch profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        _timed_steps(booster, model, opt, ids, 1, warmup=0)
    events = prof.key_averages()
    total = sum(e.self_device_time_total for e in events)
    nccl = sum(e.self_device_time_total for e in events if "nccl" in e.key.lower())
    return nccl / total if total else 0.0


def worker_tp(args: argparse.Namespace) -> dict:
    import torch
    from transformers import LlamaForCausalLM

    from megalith.booster import Booster
    from megalith.booster.plugins import HybridPlugin

    cfg = llama_config("tiny" if args.tiny else "1.1b")
    batch, seq = (2, 64) if args.tiny else (2, 2048)
    rows = []
    for tp in (1, 2, 4):
        if world_size() % tp:
            continue
        booster = Booster(
            HybridPlugin(tp_size=tp, zero_stage=1), precision="bf16" if args.device == "cuda" else "fp32"
        )
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg)
        model, opt, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
        ids = torch.randint(0, cfg.vocab_size, (batch, seq), device=next(model.parameters()).device)
        step_s = _timed_steps(booster, model, opt, ids, args.steps)
        share = _nccl_share(booster, model, opt, ids) if args.device == "cuda" else None
        rows.append({"tp": tp, "step_s": step_s, "comm_share": share})
        del model, opt, booster
    return {"rows": rows}


def worker_pp(args: argparse.Namespace) -> dict:
    from megalith.pipeline import make_schedule, simulate

    rows = []
    for name in [f"pp{p}:{s}" for p in (2, 4) for s in PP_SCHEDULES]:
        if not usable(name, world_size()):
            continue
        size, schedule = name[2:].split(":")
        p = int(size)
        sim = simulate(make_schedule(schedule, p, 2 * p, 2 if schedule == "interleaved" else 1))
        cfg = llama_config("tiny" if args.tiny else "small")
        batches = _batches(cfg, args.steps + 2, 16, 64 if args.tiny else 512)
        device = "cuda" if args.device == "cuda" else "cpu"
        t0 = time.perf_counter()
        _train_under(name, cfg, batches, "bf16" if args.device == "cuda" else "fp32", device)
        rows.append({"config": name, "bubble_ratio_simulated": sim.bubble_ratio,
                     "seconds_per_step": (time.perf_counter() - t0) / len(batches)})  # fmt: skip
    return {"rows": rows}


def worker_sync(args: argparse.Namespace) -> dict:
    import torch
    import torch.distributed as dist

    cfg = llama_config("tiny" if args.tiny else "1.1b")
    numel = cfg.vocab_size * cfg.hidden_size * 2 + cfg.num_hidden_layers * (
        4 * cfg.hidden_size**2 + 3 * cfg.hidden_size * cfg.intermediate_size
    )
    device = "cuda" if args.device == "cuda" else "cpu"
    bucket = min(numel, 128 * 2**20)  # 256 MiB of bf16
    buf = torch.empty(bucket, dtype=torch.bfloat16, device=device)
    times = []
    for _ in range(3):
        barrier()
        t0 = time.perf_counter()
        for start in range(0, numel, bucket):
            dist.broadcast(buf[: min(bucket, numel - start)], src=0)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    gb = numel * 2 / 1e9
    return {"gigabytes": gb, "seconds": min(times), "seconds_per_GB": min(times) / gb}


WORKERS = {
    "equiv": worker_equiv,
    "scaling": worker_scaling,
    "tp": worker_tp,
    "pp": worker_pp,
    "sync": worker_sync,
}


def run_worker(args: argparse.Namespace) -> None:

    from megalith.distributed import launch, shutdown

    launch(device=args.device)
    result = WORKERS[args.worker](args)
    if rank() == 0:
        Path(args.out).write_text(json.dumps(result))
    shutdown()


# ---------------------------------------------------------------------------------------------- driver
def launch_section(section: str, nproc: int, args: argparse.Namespace, configs: list[str]) -> dict:
    from megalith.common.utils import free_loopback_port

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "r.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
               "--master-addr=127.0.0.1", f"--master-port={free_loopback_port()}", __file__,
               "--worker", section, "--device", args.device, "--steps", str(args.steps), "--out", out,
               "--configs", ",".join(configs) or "-", *(["--tiny"] if args.tiny else [])]  # fmt: skip
        env = dict(os.environ, **NCCL_SAFE_ENV)
        if args.device == "cpu":
            env["OMP_NUM_THREADS"] = "1"
        done = subprocess.run(cmd, env=env)
        if done.returncode != 0:
            return {"error": f"exit code {done.returncode}", "nproc": nproc}
        return {"nproc": nproc, **json.loads(Path(out).read_text())}


def visible_devices(device: str) -> int:
    import torch

    return torch.cuda.device_count() if device == "cuda" else max(2, len(os.sched_getaffinity(0)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {SECTIONS}")
    p.add_argument(
        "--device", choices=["cuda", "cpu"], default="cuda", help="cuda (NCCL, bf16) or cpu (gloo, fp32)"
    )
    p.add_argument(
        "--nproc", type=int, default=0, help="ranks to use (default: every visible GPU / 4 on CPU)"
    )
    p.add_argument("--steps", type=int, default=5, help="timed steps per measurement (after 2 warm-up steps)")
    p.add_argument(
        "--tiny", action="store_true", help="tiny model shapes (smoke run; figures are meaningless)"
    )
    p.add_argument("--configs", default="", help="equiv: comma-separated configs (default: all that fit)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        args.configs = [c for c in args.configs.split(",") if c and c != "-"]
        run_worker(args)
        return
    nproc = args.nproc or (visible_devices(args.device) if args.device == "cuda" else 4)
    kind = f"nvidia-h200-x{nproc}" if args.device == "cuda" else f"cpu-x{nproc}"
    results: dict = {"kind": kind}
    for section in [s for s in args.sections.split(",") if s]:
        if section not in WORKERS:
            p.error(f"unknown section {section!r}; choose from {SECTIONS}")
        if section == "equiv":
            wanted = [c for c in args.configs.split(",") if c] or (
                EQUIV_CONFIGS + [f"pp{n}:{s}" for n in (2, 4) for s in PP_SCHEDULES] + ["hybrid"]
            )
            results[section] = launch_section(section, nproc, args, [c for c in wanted if usable(c, nproc)])
        elif section == "scaling":
            results[section] = [launch_section(section, n, args, []) for n in (1, 2, 4, 8) if n <= nproc]
            base = results[section][0].get("rows", [])
            for run in results[section][1:]:
                for row, ref in zip(run.get("rows", []), base, strict=False):
                    row["efficiency"] = row["tokens_per_s_per_gpu"] / ref["tokens_per_s_per_gpu"]
        else:
            results[section] = launch_section(section, nproc, args, [])
        print(json.dumps({section: results[section]}, indent=1))
    path = write_result(f"multigpu_{kind}.json", results)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
