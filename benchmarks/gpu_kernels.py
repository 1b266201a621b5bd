"""Memory-bound kernels of megalith.kernels: achieved bandwidth vs the measured copy ceiling, and
speed vs the torch eager op, at realistic shapes (16k tokens, hidden 2048 and 4096).

Bytes counted are the minimum each op must move (every input read once, every output written
once); bandwidth = bytes / time, where time is the GPU kernel time per call from the profiler's
device timeline (all kernels the call launches), as inside a training step where the host runs
ahead; `launch_ms` is one call timed with CUDA events, host launch cost included. The ceiling is
a device-to-device copy of 2 GiB measured the same way in the same run (bytes read + written /
time). `--device cpu` runs tiny shapes through whatever backend the registry picks (slow; a smoke
test).

    python benchmarks/gpu_kernels.py                 # GPU, writes results/gpu_kernels_<card>.json (h200, h100, ...)
    python benchmarks/gpu_kernels.py --device cpu    # tiny shapes, writes gpu_kernels_cpu.json
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import result_name, write_result

from megalith.kernels import FusedAdamW, apply_rotary, get_kernel, pick_backend


def bench(fn: Callable[[], Any], device: torch.device, reps: int) -> float:
    """Median seconds per call, launch included (CUDA events around one call on GPU, wall clock on
    CPU), after 3 warm-ups. Small kernels are bounded by the host's launch cost here."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def device_time(fn: Callable[[], Any], device: torch.device, reps: int) -> float:
    """Seconds of GPU kernel time per call (every kernel, memset and copy the call launches, summed
    from the profiler's device timeline): what the op costs inside a step where the host runs
    ahead. Equal to `bench` on CPU."""
    if device.type != "cuda":
        return bench(fn, device, reps)
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    total_us = sum(e.self_device_time_total for e in prof.key_averages())
    return total_us / 1e6 / reps


def copy_ceiling(device: torch.device, numel: int, reps: int) -> float:
    src = torch.empty(numel, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * numel / device_time(lambda: dst.copy_(src), device, reps)


def _hf_rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)


def _hf_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> Any:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    return apply_rotary_pos_emb(q, k, cos, sin)


def cases(tokens: int, hidden: int, inter: int, heads: int, kv: int, dev: torch.device, dt: torch.dtype):
    """(name, bytes, ours, torch eager) per kernel at one model shape."""
    b = torch.finfo(dt).bits // 8
    x = torch.randn(tokens, hidden, device=dev, dtype=dt, requires_grad=True)
    w = torch.ones(hidden, device=dev, dtype=dt, requires_grad=True)
    dy = torch.randn_like(x)
    fwd, bwd = get_kernel("rms_norm_fwd"), get_kernel("rms_norm_bwd")
    _, rstd = fwd(x.detach(), w.detach(), 1e-6)
    ref_y = _hf_rms(x, w)
    th = tokens * hidden * b
    yield "rms_norm_fwd", 2 * th, lambda: fwd(x.detach(), w.detach(), 1e-6), lambda: _hf_rms(x.detach(), w)
    yield (
        "rms_norm_bwd", 3 * th, lambda: bwd(dy, x.detach(), w.detach(), rstd),
        lambda: torch.autograd.grad(ref_y, (x, w), dy, retain_graph=True),
    )  # fmt: skip
    d, seq = hidden // heads, min(2048, tokens)
    q = torch.randn(tokens // seq, seq, heads, d, device=dev, dtype=dt).transpose(1, 2)
    k = torch.randn(tokens // seq, kv, seq, d, device=dev, dtype=dt)
    ang = torch.randn(1, seq, d // 2, device=dev)
    cos, sin = (torch.cat([f(ang)] * 2, -1).to(dt) for f in (torch.cos, torch.sin))
    qk = (q.numel() + k.numel()) * b
    yield "rope_fwd", 2 * qk, lambda: apply_rotary(q, k, cos, sin), lambda: _hf_rope(q, k, cos, sin)
    g, u = (torch.randn(tokens, inter, device=dev, dtype=dt) for _ in range(2))
    ti = tokens * inter * b
    sw_f, sw_b = get_kernel("swiglu_fwd"), get_kernel("swiglu_bwd")
    yield "swiglu_fwd", 3 * ti, lambda: sw_f(g, u), lambda: F.silu(g) * u
    gr, ur = g.clone().requires_grad_(), u.clone().requires_grad_()
    ref_h = F.silu(gr) * ur
    dh = torch.randn_like(g)
    yield (
        "swiglu_bwd", 5 * ti, lambda: sw_b(dh, g, u),
        lambda: torch.autograd.grad(ref_h, (gr, ur), dh, retain_graph=True),
    )  # fmt: skip


def adamw_case(numel: int, dev: torch.device):
    """fp32 masters: read p, g, m, v and write p, m, v (28 B/element)."""
    ps = [torch.randn(numel // 4, device=dev) for _ in range(4)]
    for p in ps:
        p.grad = torch.randn_like(p)
    ours = FusedAdamW(ps, lr=1e-4, weight_decay=0.1)
    refs = [p.clone() for p in ps]
    for p, r in zip(ps, refs, strict=True):
        r.grad = p.grad.clone()
    kind = {"foreach": True} if dev.type == "cpu" else {"fused": True}
    theirs = torch.optim.AdamW(refs, lr=1e-4, weight_decay=0.1, **kind)
    return "adamw_fp32", 28 * numel, ours.step, theirs.step, f"torch AdamW({next(iter(kind))}=True)"


def run(args: argparse.Namespace) -> dict[str, Any]:
    dev = torch.device(args.device)
    tiny = dev.type == "cpu"
    dt = torch.bfloat16 if not tiny else torch.float32
    reps = 3 if tiny else 20
    ceiling = copy_ceiling(dev, 2**20 if tiny else 2**31, reps)
    shapes = [(64, 64, 96, 4, 2)] if tiny else [(16384, 2048, 5632, 32, 4), (16384, 4096, 11008, 32, 8)]
    rows: list[dict[str, Any]] = []
    for tokens, hidden, inter, heads, kv in shapes:
        for name, nbytes, ours, ref in cases(tokens, hidden, inter, heads, kv, dev, dt):
            rows.append(_row(name, f"T={tokens} H={hidden} I={inter}", nbytes, ours, ref, dev, reps, ceiling))
    name, nbytes, ours, ref, label = adamw_case(2**14 if tiny else 2**28, dev)
    rows.append(_row(name, f"{nbytes // 28} params", nbytes, ours, ref, dev, reps, ceiling, label))
    backend = pick_backend(torch.zeros(1, device=dev, dtype=dt))
    return {"copy_ceiling_GBps": ceiling / 1e9, "dtype": str(dt), "backend": backend, "kernels": rows}


def _row(name, shape, nbytes, ours, ref, dev, reps, ceiling, ref_label="torch eager") -> dict[str, Any]:  # noqa: PLR0913
    t_ours, t_ref = device_time(ours, dev, reps), device_time(ref, dev, reps)
    row = {
        "kernel": name, "shape": shape, "bytes": nbytes, "ms": t_ours * 1e3, "torch_ms": t_ref * 1e3,
        "GBps": nbytes / t_ours / 1e9, "frac_of_copy": nbytes / t_ours / ceiling,
        "speedup_vs_torch": t_ref / t_ours, "torch_ref": ref_label,
        "launch_ms": bench(ours, dev, reps) * 1e3, "torch_launch_ms": bench(ref, dev, reps) * 1e3,
    }  # fmt: skip
    print(
        f"{name:14s} {shape:26s} {row['ms']:8.3f} ms {row['GBps']:8.1f} GB/s "
        f"{100 * row['frac_of_copy']:5.1f}% of copy  x{row['speedup_vs_torch']:.2f} vs {ref_label}  "
        f"(one call with launch: {row['launch_ms']:.3f} ms vs {row['torch_launch_ms']:.3f} ms)",
        flush=True,
    )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cuda (realistic shapes) or cpu (tiny shapes, smoke test)")  # fmt: skip
    parser.add_argument("--out", default=None, help="result file name under benchmarks/results/")
    args = parser.parse_args()
    result = run(args)
    name = args.out or result_name("gpu_kernels", args.device)
    print(f"copy ceiling {result['copy_ceiling_GBps']:.0f} GB/s; wrote {write_result(name, result)}")


if __name__ == "__main__":
    main()
