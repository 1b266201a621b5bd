"""Where the time of one training step goes, for the systems of ``gpu_train.py``.

Per system, in a fresh process each, after ``--warmup`` steps:

1. synchronizing CUDA calls made by one step (``torch.cuda.set_sync_debug_mode``), with where;
2. ``--steps`` steps timed one by one: device time between CUDA events recorded around each step
   and the host time of each step call (the two agree once the launch queue is full, i.e. when the
   host is ahead of the device and never makes it wait);
3. a kernel trace of ``--trace-steps`` steps: busy time per step by kind (matmul, attention,
   optimizer, copies and memsets, other kernels), the idle time between kernels, the largest gaps
   with the kernels on either side, and the top kernels;
4. with ``--gap-causes``, a second trace that also records the host: for each of the largest gaps,
   how late the host launched the kernel after it (launch time minus the end of the kernel before:
   positive means the device waited for the host) and the innermost host operations around that
   launch. The host-side profiler slows the host, so these gaps are larger than in step 3.

On the CPU (``--device cpu --tiny``) only the step times are measured (a smoke test of the script).

    python benchmarks/gpu_step_probe.py                     # megalith and hf_liger on the GPU
    python benchmarks/gpu_step_probe.py --device cpu --tiny --systems megalith
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_train
from _common import emit_result, result_name, run_child, write_result

KINDS = (
    ("matmul", ("nvjet", "gemm", "cutlass", "splitk")),
    ("attention", ("cudnn", "fmha", "flash")),
    ("optimizer", ("adam",)),
    ("copy", ("memcpy", "memset")),
)


def kind_of(kernel: str) -> str:
    name = kernel.lower()
    return next((kind for kind, keys in KINDS if any(k in name for k in keys)), "other")


def sync_calls(step: Any, ids: torch.Tensor) -> list[str]:
    """Distinct synchronizing CUDA calls of one step, as ``message @ file:line``."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step(ids)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    found = [f"{str(w.message).splitlines()[0][:80]} @ {w.filename}:{w.lineno}" for w in caught]
    return sorted(set(found))


def step_times(step: Any, batches: list[torch.Tensor], n: int, cuda: bool) -> dict[str, Any]:
    """Device (CUDA events) and host milliseconds of each of ``n`` steps, and the wall mean."""
    events = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)] if cuda else []
    host = []
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for i in range(n):
        if cuda:
            events[i].record()
        h0 = time.perf_counter()
        step(batches[i % len(batches)])
        host.append((time.perf_counter() - h0) * 1e3)
    if cuda:
        events[n].record()
    sync()
    wall = (time.perf_counter() - t0) * 1e3 / n
    device = [events[i].elapsed_time(events[i + 1]) for i in range(n)] if cuda else host
    return {"wall_ms": wall, "device_ms": device, "host_ms": host}


def traced_steps(
    step: Any, ids: torch.Tensor, n: int, host: bool
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The chrome-trace events of ``n`` profiled steps (the host's too if ``host``) and, sorted by
    start time, the device events among them: kernels, copies and memsets."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if host else [ProfilerActivity.CUDA]
    with profile(activities=activities) as prof:
        for _ in range(n):
            step(ids)
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        events = json.loads(Path(path).read_text())["traceEvents"]
    kernels = sorted(
        (e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e),
        key=lambda e: e["ts"],
    )
    return events, kernels


def kernel_trace(step: Any, ids: torch.Tensor, n: int) -> dict[str, Any]:
    """Busy time by kind, idle gaps and top kernels per step, from a profiler trace of ``n`` steps."""
    _, kernels = traced_steps(step, ids, n, host=False)
    busy: dict[str, float] = {}
    top: dict[str, float] = {}
    gaps: list[tuple[float, str, str]] = []
    idle, end, last = 0.0, kernels[0]["ts"], kernels[0]["name"]
    for e in kernels:
        busy[kind_of(e["name"])] = busy.get(kind_of(e["name"]), 0.0) + e["dur"]
        top[e["name"][:90]] = top.get(e["name"][:90], 0.0) + e["dur"]
        gap = e["ts"] - end
        if gap > 0:
            idle += gap
            gaps.append((gap, last[:60], e["name"][:60]))
        if e["ts"] + e["dur"] >= end:
            end, last = e["ts"] + e["dur"], e["name"]
    span = end - kernels[0]["ts"]
    per_step = 1e3 * n  # trace times are in µs; report ms per step
    return {
        "kernels_per_step": len(kernels) / n,
        "span_ms": span / per_step,
        "busy_ms": {k: round(v / per_step, 3) for k, v in sorted(busy.items(), key=lambda kv: -kv[1])},
        "idle_ms": idle / per_step,
        "largest_gaps_us": [[round(g, 1), a, b] for g, a, b in sorted(gaps, reverse=True)[:10]],
        "top_kernels_ms": {
            k: round(v / per_step, 3) for k, v in sorted(top.items(), key=lambda kv: -kv[1])[:20]
        },
    }


def gap_causes(step: Any, ids: torch.Tensor, n: int, top: int = 12) -> dict[str, Any]:
    """The largest gaps between kernels of ``n`` steps, each with the host's launch delay and ops."""
    events, kernels = traced_steps(step, ids, n, host=True)
    launches = {
        e["args"]["correlation"]: e
        for e in events
        if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})
    }
    ops: dict[Any, list[dict[str, Any]]] = {}
    for e in events:
        if e.get("cat") in ("cpu_op", "user_annotation", "python_function") and "dur" in e:
            ops.setdefault(e["tid"], []).append(e)
    rows: list[dict[str, Any]] = []
    host_late = 0.0
    end, last = kernels[0]["ts"] + kernels[0]["dur"], kernels[0]["name"]
    for e in kernels[1:]:
        gap = e["ts"] - end
        launch = launches.get(e.get("args", {}).get("correlation"))
        if gap > 0 and launch is not None:
            late = launch["ts"] + launch.get("dur", 0.0) - end
            host_late += max(0.0, min(gap, late))
            enclosing = [
                o for o in ops.get(launch["tid"], []) if o["ts"] <= launch["ts"] <= o["ts"] + o["dur"]
            ]
            names = [o["name"][:70] for o in sorted(enclosing, key=lambda o: o["dur"])[:4]]
            rows.append({"gap_us": round(gap, 1), "host_late_us": round(late, 1), "before": last[:50],
                         "after": e["name"][:50], "host_ops": names})  # fmt: skip
        if e["ts"] + e["dur"] >= end:
            end, last = e["ts"] + e["dur"], e["name"]
    rows.sort(key=lambda r: -r["gap_us"])
    idle = sum(r["gap_us"] for r in rows)
    return {
        "idle_ms": idle / (1e3 * n),
        "host_late_ms": host_late / (1e3 * n),
        "largest": rows[:top],
    }


def child(system: str, args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    model, step, info = gpu_train.build(system, args, device)
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    batches = [torch.randint(0, vocab, (args.batch, args.seq), generator=g).to(device) for _ in range(2)]
    for i in range(args.warmup):
        step(batches[i % 2])
    row: dict[str, Any] = {"name": system, **info}
    if cuda:
        row["sync_calls"] = sync_calls(step, batches[0])
    row["steps"] = step_times(step, batches, args.steps, cuda)
    row["tokens_per_s"] = args.batch * args.seq / (row["steps"]["wall_ms"] / 1e3)
    if cuda:
        row["trace"] = kernel_trace(step, batches[0], args.trace_steps)
        if args.gap_causes:
            row["gap_causes"] = gap_causes(step, batches[0], args.trace_steps)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cuda or cpu"
    )
    parser.add_argument("--tiny", action="store_true", help="tiny model (hidden 64, 2 layers)")
    parser.add_argument(
        "--systems",
        nargs="*",
        choices=gpu_train.SYSTEMS,
        default=["megalith", "hf_liger"],
        help="systems of gpu_train.py to probe (default: megalith hf_liger)",
    )
    parser.add_argument("--batch", type=int, default=None, help="micro-batch size (default 8; tiny: 2)")
    parser.add_argument("--seq", type=int, default=None, help="sequence length (default 2048; tiny: 32)")
    parser.add_argument("--warmup", type=int, default=4, help="untimed steps first (default 4)")
    parser.add_argument("--steps", type=int, default=8, help="steps timed one by one (default 8)")
    parser.add_argument("--trace-steps", type=int, default=3, help="steps in the kernel trace (default 3)")
    parser.add_argument(
        "--gap-causes",
        action="store_true",
        help="also trace the host and attribute the largest gaps between kernels (GPU only)",
    )
    parser.add_argument("--timeout", type=float, default=900, help="seconds per system process")
    parser.add_argument("--child", choices=gpu_train.SYSTEMS, help=argparse.SUPPRESS)
    parser.add_argument(
        "--out",
        default=None,
        help="result file under benchmarks/results/ (default gpu_step_probe_<card: h200, h100, ...>.json)",
    )
    args = parser.parse_args()
    args.batch = args.batch or (2 if args.tiny else 8)
    args.seq = args.seq or (32 if args.tiny else 2048)
    args.kernels, args.multi_tensor = None, False  # what gpu_train.build reads besides the shape
    if args.steps < 1 or args.trace_steps < 1 or args.warmup < 0:
        parser.error(f"need --steps >= 1, --trace-steps >= 1, --warmup >= 0; got {args.steps}, "
                     f"{args.trace_steps}, {args.warmup}")  # fmt: skip
    if args.child:
        emit_result(child(args.child, args))
        return
    forwarded = ["--device", args.device, "--batch", str(args.batch), "--seq", str(args.seq)]
    forwarded += ["--warmup", str(args.warmup), "--steps", str(args.steps)]
    forwarded += ["--trace-steps", str(args.trace_steps), *(["--tiny"] if args.tiny else [])]
    forwarded += ["--gap-causes"] if args.gap_causes else []
    rows = []
    for system in args.systems:
        cmd = [sys.executable, __file__, "--child", system, *forwarded]
        row, proc = run_child(cmd, args.timeout)
        if row is None:
            rows.append({"name": system, "error": (proc.stderr or proc.stdout)[-2000:]})
            print(f"{system}: FAILED\n{rows[-1]['error']}", flush=True)
            continue
        rows.append(row)
        steps = rows[-1]["steps"]
        print(f"{system}: {rows[-1]['tokens_per_s']:.0f} tok/s, wall {steps['wall_ms']:.1f} ms/step, "
              f"device {[round(x, 1) for x in steps['device_ms']]}", flush=True)  # fmt: skip
        if "trace" in rows[-1]:
            t = rows[-1]["trace"]
            print(f"  busy {t['busy_ms']} idle {t['idle_ms']:.2f} ms over {t['kernels_per_step']:.0f} kernels; "
                  f"sync calls: {rows[-1]['sync_calls']}", flush=True)  # fmt: skip
        for gap in rows[-1].get("gap_causes", {}).get("largest", []):
            print(f"  gap {gap}", flush=True)
    name = args.out or result_name("gpu_step_probe", args.device)
    payload = {"batch": args.batch, "seq": args.seq, "warmup": args.warmup, "systems": rows}
    print(f"wrote {write_result(name, payload)}")


if __name__ == "__main__":
    main()
