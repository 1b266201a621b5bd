"""Training throughput of the 1.1B TinyLlama shape on one GPU: HF eager, HF + torch.compile,
HF + Liger-Kernel, megalith (Booster: kernels rope/swiglu/cross_entropy, compile=True,
ZeroPlugin(stage=2), bf16-true, multi-tensor FusedAdamW).

Every system runs in a fresh subprocess (no cross-contamination of caches, compiled graphs or
allocator state) on the same micro-batch (batch 8 × 2048, no accumulation), SDPA attention and a
fused AdamW. MFU = tokens/s × (6·N_nonembed + 12·layers·hidden·seq) / 768e12, with N_nonembed all
parameters but the input embedding (the untied LM head counts). Every system trains in pure bf16
(bf16 weights, gradients and AdamW states): the peers with torch AdamW(fused=True), megalith with
`precision="bf16-true"` and `megalith.kernels.FusedAdamW`. `megalith_mixed` is the same Booster with
fp32 master weights and states (`precision="bf16"`) for reference.

    python benchmarks/gpu_train.py                       # GPU, writes results/gpu_train_<card>.json (h200, h100, ...)
    python benchmarks/gpu_train.py --device cpu --tiny   # smoke test (tiny shape, eager + megalith)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit_result, result_name, run_child, write_result

PEAK_FLOPS = 768e12  # measured bf16 dense matmul ceiling of one H200 (see the project's issue)
SYSTEMS = (
    "hf_eager",
    "hf_compile",
    "hf_liger",
    "megalith",
    "megalith_cdt",
    "megalith_eager",
    "megalith_mixed",
    "megalith_multi_tensor",
    "kernels_bf16",
)
DEFAULT_SYSTEMS = ("hf_eager", "hf_compile", "hf_liger", "megalith", "megalith_eager")
# megalith_cdt: megalith with Inductor's coordinate-descent tuning of its generated kernels
# (Booster(compile_options={"coordinate_descent_tuning": True})); megalith_eager: the Booster path without compile; megalith_mixed: with fp32 masters;
# megalith_multi_tensor: megalith_eager with FusedAdamW(multi_tensor=True); kernels_bf16:
# megalith's kernel policy alone (torch fused AdamW, no Booster) - the like-for-like kernel comparison.
# Under compile, RMSNorm is left to inductor (fused with the residual add around it) and AdamW runs
# multi-tensor: the fastest of the variants measured in one run (results/gpu_train_h200_variant_*.json).
COMPILED_KERNELS = ("rope", "swiglu", "cross_entropy")
TINYLLAMA = dict(
    vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
    num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048,
)  # fmt: skip
TINY = dict(
    vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64,
)  # fmt: skip


def build(system: str, args: argparse.Namespace, device: torch.device) -> tuple[Any, Any, Any]:
    """(model, step_fn, extra info) for one system."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if system == "hf_liger":
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama(
            rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=True
        )
    config = LlamaConfig(**(TINY if args.tiny else TINYLLAMA), attn_implementation="sdpa")
    torch.manual_seed(0)
    with device:
        model = LlamaForCausalLM(config)
    if system.startswith("megalith"):
        compile = system in ("megalith", "megalith_cdt", "megalith_mixed") and device.type == "cuda"
        multi = system in ("megalith", "megalith_cdt", "megalith_multi_tensor") or args.multi_tensor
        kernels = args.kernels.split(",") if args.kernels else (COMPILED_KERNELS if compile else True)
        return _megalith(
            model,
            device,
            compile=compile,
            mixed=system == "megalith_mixed",
            multi_tensor=multi,
            kernels=kernels,
            options={"coordinate_descent_tuning": True} if compile and system == "megalith_cdt" else None,
        )
    model.to(torch.bfloat16 if device.type == "cuda" else torch.float32)
    if system == "kernels_bf16":
        from megalith.policies.kernels import apply_kernels

        apply_kernels(model)
    if system == "hf_compile":
        model.compile()
    fused = {"fused": True} if device.type == "cuda" else {}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, **fused)

    def step(ids: torch.Tensor) -> float:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return model, step, {"optimizer": f"torch AdamW({'fused' if fused else 'foreach'})", "weights": "bf16"}


def _megalith(
    model: Any,
    device: torch.device,
    compile: bool,
    mixed: bool,
    multi_tensor: bool,
    kernels: Any,
    options: dict[str, Any] | None = None,
) -> tuple[Any, Any, Any]:
    from megalith.booster import Booster
    from megalith.booster.plugins import ZeroPlugin
    from megalith.kernels import FusedAdamW

    precision = "fp32" if device.type != "cuda" else "bf16" if mixed else "bf16-true"
    booster = Booster(
        plugin=ZeroPlugin(stage=2),
        precision=precision,
        kernels=kernels,
        compile=compile,
        compile_options=options,
    )
    opt = FusedAdamW(model.parameters(), lr=1e-4, weight_decay=0.1, multi_tensor=multi_tensor)
    model, opt, *_ = booster.boost(model, opt)

    def step(ids: torch.Tensor, zero: bool = True) -> float:
        loss = model(input_ids=ids, labels=ids).loss
        booster.backward(loss, opt)
        opt.step()
        if zero:  # (a step captured in a CUDA graph keeps its gradient buffers)
            opt.zero_grad()
        return loss

    weights = {"bf16": "bf16 + fp32 masters", "bf16-true": "bf16"}.get(precision, precision)
    name = "megalith FusedAdamW" + (" (multi-tensor)" if multi_tensor else "")
    info = {"optimizer": name, "weights": weights, "compile": compile} | (
        {"compile_options": options} if options else {}
    )
    return model, step, info | ({"kernels": sorted(kernels)} if kernels is not True else {})


def child(system: str, args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    model, step, info = build(system, args, device)
    cfg = model.config
    n_nonembed = sum(p.numel() for p in model.parameters()) - model.get_input_embeddings().weight.numel()
    flops_per_token = 6 * n_nonembed + 12 * cfg.num_hidden_layers * cfg.hidden_size * args.seq
    g = torch.Generator().manual_seed(0)
    batches = [
        torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=g).to(device) for _ in range(2)
    ]
    t0 = time.perf_counter()
    for i in range(args.warmup):
        step(batches[i % 2])
    _sync(device)
    warmup_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i in range(args.steps):
        loss = step(batches[i % 2])
    _sync(device)
    elapsed = time.perf_counter() - t0
    tokens_per_s = args.batch * args.seq * args.steps / elapsed
    if args.profile and device.type == "cuda":
        _profile(step, batches[0])
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
    return {
        "name": system, "tokens_per_s": tokens_per_s, "step_s": elapsed / args.steps,
        "mfu": tokens_per_s * flops_per_token / PEAK_FLOPS, "peak_mem_GiB": peak,
        "final_loss": float(loss.detach()), "warmup_s": warmup_s, "n_nonembed": n_nonembed, **info,
    }  # fmt: skip


def _profile(step: Any, ids: torch.Tensor) -> None:
    """Top GPU kernels of two steps (to stderr, which the parent shows)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            step(ids)
        torch.cuda.synchronize()
    print(
        prof.key_averages().table(sort_by="cuda_time_total", row_limit=80, max_name_column_width=90),
        file=sys.stderr,
    )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def parent(args: argparse.Namespace, save: Any) -> list[dict[str, Any]]:
    """Each system in its own process; ``save(rows, done)`` after each (a cut-off run keeps its rows)."""
    systems = args.systems or (DEFAULT_SYSTEMS if args.device == "cuda" else ("hf_eager", "megalith"))
    rows: list[dict[str, Any]] = []
    for system in systems:
        cmd = [sys.executable, __file__, "--child", system, *_forward_args(args)]
        t0 = time.perf_counter()
        row, proc = run_child(cmd, args.timeout)
        if row is None:
            row = {"name": system, "error": (proc.stderr or proc.stdout)[-2000:]}
        row["wall_s"] = time.perf_counter() - t0
        if args.profile:
            print(proc.stderr[-30000:], flush=True)
        rows.append(row)
        print(_fmt(row), flush=True)
        save(rows, len(rows) == len(systems))
    return rows


def _forward_args(args: argparse.Namespace) -> list[str]:
    out = ["--device", args.device, "--batch", str(args.batch), "--seq", str(args.seq)]
    out += ["--warmup", str(args.warmup), "--steps", str(args.steps)]
    out += ["--profile"] if args.profile else []
    out += ["--multi-tensor"] if args.multi_tensor else []
    out += ["--kernels", args.kernels] if args.kernels else []
    return out + (["--tiny"] if args.tiny else [])


def _fmt(row: dict[str, Any]) -> str:
    if "error" in row:
        return f"{row['name']:12s} FAILED: {row['error'].strip().splitlines()[-1] if row['error'].strip() else '?'}"
    mem = f"{row['peak_mem_GiB']:.1f} GiB" if row["peak_mem_GiB"] is not None else "-"
    return f"{row['name']:12s} {row['tokens_per_s']:10.0f} tok/s  MFU {row['mfu']:.3f}  peak {mem}  loss {row['final_loss']:.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cuda or cpu"
    )
    parser.add_argument(
        "--tiny", action="store_true", help="tiny model (hidden 64, 2 layers) for smoke tests"
    )
    parser.add_argument("--batch", type=int, default=None, help="micro-batch size (default 8; tiny: 2)")
    parser.add_argument("--seq", type=int, default=None, help="sequence length (default 2048; tiny: 32)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 4; tiny: 1)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 10; tiny: 2)")
    parser.add_argument("--systems", nargs="*", choices=SYSTEMS, help="subset of systems to run")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per system subprocess")
    parser.add_argument("--profile", action="store_true", help="print each system's top GPU kernels")
    parser.add_argument(
        "--multi-tensor", action="store_true", help="megalith systems use FusedAdamW(multi_tensor=True)"
    )
    parser.add_argument(
        "--kernels",
        default=None,
        help="megalith systems swap in only these kernels (comma-separated of rms_norm, rope, swiglu, "
        "cross_entropy, qkv; default: all for the eager systems, " + ",".join(COMPILED_KERNELS) + " for the "
        "compiled megalith system)",
    )
    parser.add_argument("--child", choices=SYSTEMS, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help="result file name under benchmarks/results/")
    args = parser.parse_args()
    small = args.tiny
    args.batch = args.batch or (2 if small else 8)
    args.seq = args.seq or (32 if small else 2048)
    args.warmup = args.warmup if args.warmup is not None else (1 if small else 4)
    args.steps = args.steps or (2 if small else 10)
    if args.child:
        emit_result(child(args.child, args))
        return
    name = args.out or result_name("gpu_train", args.device)
    payload = {"batch": args.batch, "seq": args.seq, "steps": args.steps, "warmup": args.warmup,
               "peak_flops": PEAK_FLOPS}  # fmt: skip

    def save(rows: list[dict[str, Any]], done: bool) -> None:
        path = write_result(name, payload | {"systems": rows, "complete": done})
        if done:
            print(f"wrote {path}")

    parent(args, save)


if __name__ == "__main__":
    main()
