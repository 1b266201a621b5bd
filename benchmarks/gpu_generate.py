"""Rollout generation speed: megalith's fast engine vs HF ``generate`` (default and static cache).

Model: a randomly initialised Llama of the 0.37B shape (hidden 1024, intermediate 2816, 24 layers,
16 heads = 16 KV heads, vocab 32000, untied head) in bfloat16; prompts of 128 random tokens, 256
new tokens, sampling at temperature 1 (no top-k/top-p), no EOS, so every row decodes all 256.
Each system runs in its own process (``--worker``); the main process measures the copy bandwidth
and writes ``benchmarks/results/gpu_generate_<card>.json`` (``h200``, ``h100``, ...). ``fast`` is the engine's default
configuration (split-KV Triton decode attention, compiled elementwise ops, fused decode prologue,
CUDA graphs); it is also timed with the QKV prologue as a kernel of its own instead of inside the
decode attention (``separate_prologue_tokens_per_s``), then as the default again, in the same
process. ``fast_grouped`` is the same engine with ``share_prompts=True`` on ``B / 8`` prompts of
8 samples each (GRPO's groups) given as ``generate(..., group=8)``: each prompt is prefilled once and
its cache slots are read once per group; it also records ``unshared_tokens_per_s``, the same
prompts without ``group``, in the same process, and at the first batch the log-prob error of both
against a teacher-forced HF forward. On CUDA ``fast`` is also timed with its projections by the
split-K Triton matmul of ``fast_gemm`` (``triton_gemm_tokens_per_s``, tiles from
``--gemm-configs``), then with cuBLAS and Triton again, in the same process, with the same
correctness check (``triton_gemm_check``). ``fast_sdpa`` swaps in SDPA for the decode attention;
``fast_nocompile`` / ``fast_eager`` drop the compiled ops / the graphs too.

Memory-bound floor (new tokens/s): a decode step must read every weight that takes part in it
(all but the embedding table, of which only ``B`` rows are read) plus the KV cache of the mean
context ``P + N/2``; ``floor = B * bandwidth / bytes_per_step`` with the bandwidth of a large
device-to-device copy (bytes read + written) measured in the same run.

Per engine run also: ``prefill_s`` (the prompt pass alone) and ``decode_step_ms`` (the rest of a
``generate`` per decode step).

Also measured: a GRPO step (generate 8 prompts x G=8 -> policy-gradient update -> weight sync)
with the fast engine vs HF generate, in one process each.

    python benchmarks/gpu_generate.py                      # on a GPU machine
    python benchmarks/gpu_generate.py --device cpu --tiny  # smoke test
    python benchmarks/gpu_generate.py --systems fast --batches 64 --profile  # + decode-step profile
    python benchmarks/gpu_generate.py --systems fast --gemm-configs best:results/gpu_decode_gemm_h100.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import RESULTS, card, emit_result, environment, run_child

SYSTEMS = (
    "fast",
    "fast_grouped",
    "fast_sdpa",
    "hf_static",
    "hf_dynamic",
    "grpo_fast",
    "grpo_hf",
    "fast_nocompile",
    "fast_eager",
)


def model_config(tiny: bool) -> dict[str, Any]:
    if tiny:
        return dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=128,
        )
    return dict(
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=24,
        num_attention_heads=16,
        num_key_value_heads=16,
        vocab_size=32000,
    )


def build_model(args: argparse.Namespace) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        **model_config(args.tiny),
        max_position_embeddings=1024,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=None,
        tie_word_embeddings=False,
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(args.device):
        model = LlamaForCausalLM(cfg)
    model = model.to(torch.bfloat16 if args.device == "cuda" else torch.float32).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


GROUP = 8  # samples per prompt of fast_grouped (GRPO's default group size)


def prompts(args: argparse.Namespace, batch: int, vocab: int) -> tuple[Any, Any]:
    import torch

    g = torch.Generator().manual_seed(batch)
    ids = torch.randint(1, vocab, (batch, args.prompt_len), generator=g)
    return ids.to(args.device), torch.ones_like(ids).to(args.device)


def timed(fn: Any, device: str, reps: int) -> float:
    times = []
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return min(times)


def run_hf(args: argparse.Namespace, model: Any, batch: int, static: bool) -> dict[str, Any]:
    ids, mask = prompts(args, batch, model.config.vocab_size)
    kw: dict[str, Any] = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=0)
    if static:
        kw["cache_implementation"] = "static"

    def go(n: int) -> None:
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, **kw)

    t0 = time.perf_counter()
    go(args.new_tokens if static else 4)  # static: allocates the cache of the timed length
    warm = time.perf_counter() - t0
    seconds = timed(
        lambda: go(args.new_tokens), args.device, 1 if args.device == "cuda" and not static else 2
    )
    return {
        "batch": batch,
        "seconds": seconds,
        "warmup_s": warm,
        "tokens_per_s": batch * args.new_tokens / seconds,
    }


def run_fast(args: argparse.Namespace, model: Any, batch: int, mode: str) -> dict[str, Any]:
    from megalith_chat.engine.fast import FastEngine, FastEngineConfig
    from megalith_chat.engine.sampling import SamplingParams

    cfg = FastEngineConfig(
        max_batch=batch,
        max_len=args.prompt_len + args.new_tokens,
        cuda_graphs=mode != "fast_eager",
        compile_ops=mode in ("fast", "fast_grouped", "fast_sdpa"),
        attention="sdpa" if mode == "fast_sdpa" else "auto",
        share_prompts=mode == "fast_grouped",
    )
    engine = FastEngine(model, cfg, device=args.device)
    group = GROUP if mode == "fast_grouped" and batch % GROUP == 0 else 1
    ids, mask = prompts(args, batch // group, model.config.vocab_size)
    ids, mask = ids.repeat_interleave(group, 0), mask.repeat_interleave(group, 0)
    params = SamplingParams(args.new_tokens, temperature=1.0)
    t0 = time.perf_counter()
    engine.generate(ids, mask, params, group=group)  # captures one graph per KV bucket (and compiles)
    warm = time.perf_counter() - t0
    seconds = timed(lambda: engine.generate(ids, mask, params, group=group), args.device, 3)
    prefill = prefill_seconds(args, engine, ids, mask, params, group)
    out: dict[str, Any] = {"group": group, "members": engine._members(ids, mask, group, engine.bucket(batch))}
    if group > 1:  # the same prompts without sharing, same process
        out["unshared_tokens_per_s"] = ungrouped_rate(args, engine, ids, mask, params)
        if batch == args.batches[0]:
            out["check"] = {
                name: logprob_error(model, ids, mask, engine.generate(ids, mask, params, group=g))
                for name, g in (("shared", group), ("unshared", 1))
            }
    out |= {
        "batch": batch,
        "seconds": seconds,
        "prefill_s": prefill,
        "decode_step_ms": (seconds - prefill) / max(1, args.new_tokens - 1) * 1e3,
        "warmup_s": warm,
        "tokens_per_s": batch * args.new_tokens / seconds,
        "graphs": len(engine._graphs),
        "compiled_ops": engine.compiled_ops,
        "attention": engine.attention,
    }
    if mode == "fast" and engine.prologue_in_attention:  # A/B in this process: the prologue kernel apart
        for name, inside in (("separate_prologue", False), ("in_attention_again", True)):
            engine.prologue_in_attention = inside  # graphs are keyed by it: the first call captures
            out[f"{name}_tokens_per_s"] = ungrouped_rate(args, engine, ids, mask, params)
    if mode == "fast" and args.device == "cuda" and args.gemm_configs:  # A/B: split-K Triton projections
        out |= triton_gemm_ab(args, model, engine, ids, mask, params)
    if batch == args.batches[0] and mode == "fast":
        out["check"] = correctness(args, model, engine)
        if args.profile:
            out["profile"] = decode_profile(args, engine, batch)
    if args.profile and group > 1:  # the same step with and without the shared prompt slots
        out["profile"] = decode_profile(args, engine, batch, group)
        out["unshared_profile"] = decode_profile(args, engine, batch)
    return out


def ungrouped_rate(args: argparse.Namespace, engine: Any, ids: Any, mask: Any, params: Any) -> float:
    """New tokens/s of ``generate`` without ``group``, after an untimed call (which captures)."""
    engine.generate(ids, mask, params)
    seconds = timed(lambda: engine.generate(ids, mask, params), args.device, 3)
    return ids.shape[0] * args.new_tokens / seconds


def triton_gemm_ab(
    args: argparse.Namespace, model: Any, engine: Any, ids: Any, mask: Any, params: Any
) -> dict[str, Any]:
    """The engine with its projections by ``fast_gemm`` (tiles from ``--gemm-configs``), then by
    cuBLAS, then by Triton again; at the first batch also its correctness check (and profile)."""
    batch = ids.shape[0]
    tiles = gemm_configs(args.gemm_configs, batch)
    out: dict[str, Any] = {"triton_gemm_configs": {k: str(v) for k, v in tiles._asdict().items()}}
    for name, gemm in (("triton_gemm", tiles), ("cublas_again", None), ("triton_gemm_again", tiles)):
        engine.gemm = gemm  # graphs are keyed by it: the first call captures
        out[f"{name}_tokens_per_s"] = ungrouped_rate(args, engine, ids, mask, params)
    if batch == args.batches[0]:
        out["triton_gemm_check"] = correctness(args, model, engine)
        if args.profile:
            out["triton_gemm_profile"] = decode_profile(args, engine, batch)
    engine.gemm = None
    return out


PROJECTION_VARIANT = {
    "qkv": "triton",
    "o": "triton_residual",
    "gate_up": "triton_swiglu",
    "down": "triton_residual",
}


def gemm_configs(text: str, batch: int) -> Any:
    """``--gemm-configs``: one tile configuration for every projection, ``qkv=..,o=..,gate_up=..,down=..``,
    or ``best:<gpu_decode_gemm result>``: per projection, the fastest of the Triton variant the engine
    runs (``PROJECTION_VARIANT``) at the measured row count nearest ``batch``."""
    from megalith.common.errors import ConfigError
    from megalith_chat.engine.fast_gemm import GemmConfig, ProjectionConfigs

    if text.startswith("best:"):
        rows = json.loads(Path(text[5:]).read_text())["rows"]
        timed_rows = min(rows, key=lambda r: abs(int(r) - batch))
        best = {}
        for proj, variant in PROJECTION_VARIANT.items():
            times = {k: v for k, v in rows[timed_rows][proj].items() if k.startswith(variant + "[")}
            best[proj] = GemmConfig.parse(min(times, key=times.__getitem__)[len(variant) + 1 : -1])
        return ProjectionConfigs(**best)
    if "=" not in text:
        return ProjectionConfigs(*[GemmConfig.parse(text)] * 4)
    pairs = dict(part.split("=", 1) for part in text.split(","))
    unknown = sorted(set(pairs) - set(ProjectionConfigs._fields))
    if unknown:
        raise ConfigError(
            f"--gemm-configs: unknown projection {unknown[0]!r}, not one of {ProjectionConfigs._fields}"
        )
    return ProjectionConfigs(**{k: GemmConfig.parse(v) for k, v in pairs.items()})


def prefill_seconds(
    args: argparse.Namespace, engine: Any, ids: Any, mask: Any, params: Any, group: int = 1
) -> float:
    """Time of the prompt pass alone (cache fill + last-position logits), best of three: what a
    ``generate`` spends before its first decode step (one prompt per ``group`` rows when shared)."""
    st, b = engine.state, engine.bucket(ids.shape[0])
    every = engine._members(ids, mask, group, b)
    start = st.prepare(ids, mask, b, params, (), 0)
    rows = st.prompt_rows(ids, b, 0)
    return timed(lambda: engine._prefill(rows[::every], start[::every], every), args.device, 3)


def decode_profile(args: argparse.Namespace, engine: Any, batch: int, members: int = 1) -> dict[str, Any]:
    """One decode step at the mean context ``P + N/2``: its time as the engine runs it (graph replay
    on CUDA; includes two tiny counter resets) and the kernels of the same step run eagerly (device
    time per step, by kernel name). ``members > 1``: rows in groups of that many sharing their prompt
    slots (the engine's ``prompt_end`` is the prompt width of its last ``generate``)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    st, block, reps = engine.state, engine.config.kv_block, 20
    slot = args.prompt_len + args.new_tokens // 2 - 1
    kv_len = min(-(-(slot + 1) // block) * block, engine.max_len)

    def rewind() -> None:  # the step advances the slot and the output column: put both back
        st.slot.fill_(slot)
        st.ridx.fill_(0)

    rewind()
    engine._step(batch, kv_len, False, members)  # captures the graph if needed
    sync(args.device)
    t0 = time.perf_counter()
    for _ in range(reps):
        rewind()
        engine._step(batch, kv_len, False, members)
    sync(args.device)
    step_ms = (time.perf_counter() - t0) / reps * 1e3
    cuda = args.device == "cuda"
    activity = ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU
    with profile(activities=[activity]) as prof:
        for _ in range(5):
            rewind()
            engine._decode_body(engine._key(batch, kv_len, False, members))
        sync(args.device)
    kind = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    totals: dict[str, float] = {}
    for ev in prof.events():
        if ev.device_type == kind:
            us = (ev.device_time if cuda else ev.self_cpu_time_total) / 5
            totals[ev.name[:80]] = totals.get(ev.name[:80], 0.0) + us
    top = sorted(totals.items(), key=lambda kv: -kv[1])[:15]
    return {
        "slot": slot,
        "kv_len": kv_len,
        "step_ms": step_ms,
        "kernel_us_sum": sum(totals.values()),
        "top_kernels_us": {name: round(us, 1) for name, us in top},
    }


def correctness(args: argparse.Namespace, model: Any, engine: Any) -> dict[str, float]:
    """Greedy agreement with HF generate and log-prob error vs a teacher-forced HF forward."""
    from megalith_chat.engine.sampling import SamplingParams

    ids, mask = prompts(args, 8, model.config.vocab_size)
    n = min(32, args.new_tokens)
    engine.reserve(8, ids.shape[1] + n)
    ours = engine.generate(ids, mask, SamplingParams(n, greedy=True)).tokens
    hf = model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
        pad_token_id=0,
    )[:, ids.shape[1] :].cpu()
    first_diff = (ours != hf).int().argmax(dim=1).float()
    first_diff[(ours == hf).all(dim=1)] = n
    sampled = engine.generate(ids, mask, SamplingParams(n, temperature=1.0))
    return {
        "greedy_tokens_equal_frac": float((ours == hf).float().mean()),
        "greedy_first_diff_mean": float(first_diff.mean()),
        **logprob_error(model, ids, mask, sampled),
    }


def logprob_error(model: Any, ids: Any, mask: Any, result: Any) -> dict[str, float]:
    """Sampled log-probs of an engine ``generate`` against a teacher-forced HF forward."""
    import torch

    from megalith_chat.rollout.generation import response_logprobs

    tokens = result.tokens.to(ids.device)
    with torch.no_grad():
        ref = response_logprobs(model, ids, mask, tokens, torch.ones_like(tokens))
    err = (ref.float().cpu() - result.logprobs).abs()
    return {"logprob_abs_err_max": float(err.max()), "logprob_abs_err_mean": float(err.mean())}


def run_grpo(args: argparse.Namespace, model: Any, fast: bool) -> dict[str, Any]:
    """Steps of: sample 8 prompts x G=8 -> GRPO policy-gradient update (AdamW) -> weight sync."""
    import torch

    from megalith_chat.algorithms import grpo_advantages
    from megalith_chat.engine.fast import FastEngine, FastEngineConfig
    from megalith_chat.engine.sampling import SamplingParams
    from megalith_chat.rollout.generation import response_logprobs

    group, batch, new = 8, 64, args.grpo_new_tokens
    ids, mask = prompts(args, batch // group, model.config.vocab_size)
    ids, mask = ids.repeat_interleave(group, 0), mask.repeat_interleave(group, 0)
    engine = (
        FastEngine(
            model, FastEngineConfig(max_batch=batch, max_len=args.prompt_len + new), device=args.device
        )
        if fast
        else None
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=args.device == "cuda")
    rows = []
    for _ in range(args.grpo_steps + 1):
        sync(args.device)
        t0 = time.perf_counter()
        if engine is not None:
            resp = engine.generate(ids, mask, SamplingParams(new, temperature=1.0)).tokens.to(args.device)
        else:
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                pad_token_id=0,
            )
            resp = out[:, ids.shape[1] :]
        sync(args.device)
        t1 = time.perf_counter()
        adv = grpo_advantages(torch.rand(batch), group).to(args.device)
        rmask = torch.ones_like(resp)
        model.train()
        for lo in range(0, batch, 16):
            logp = response_logprobs(
                model, ids[lo : lo + 16], mask[lo : lo + 16], resp[lo : lo + 16], rmask[lo : lo + 16]
            )
            loss = -(adv[lo : lo + 16, None] * logp).sum() / rmask.sum()
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        model.eval()
        sync(args.device)
        t2 = time.perf_counter()
        if engine is not None:
            engine.update_weights(model)
        sync(args.device)
        rows.append(
            {
                "generate_s": t1 - t0,
                "train_s": t2 - t1,
                "sync_s": time.perf_counter() - t2,
                "step_s": time.perf_counter() - t0,
            }
        )
    steady = rows[1:]
    mean = {k: sum(r[k] for r in steady) / len(steady) for k in steady[0]}
    return {
        "batch": batch,
        "group": group,
        "new_tokens": new,
        "steps": len(steady),
        **mean,
        "first_step_s": rows[0]["step_s"],
    }


def worker(args: argparse.Namespace) -> None:
    model = build_model(args)
    name = args.worker
    results: list[dict[str, Any]] = []
    if name.startswith("grpo"):
        results.append(run_grpo(args, model, name == "grpo_fast"))
    else:
        batches = args.batches[:1] if name in ("fast_nocompile", "fast_eager", "fast_sdpa") else args.batches
        for b in batches:
            if name.startswith("fast"):
                results.append(run_fast(args, model, b, name))
            else:
                results.append(run_hf(args, model, b, static=name == "hf_static"))
            print(f"{name} batch {b}: {results[-1]}", file=sys.stderr, flush=True)
    emit_result(results)


def copy_bandwidth(device: str, gib: float) -> float:
    """Bytes read + written per second of a large device-to-device copy (best of 10)."""
    import torch

    n = int(gib * 2**30) // 4
    src = torch.empty(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = min(timed(lambda: dst.copy_(src), device, 1) for _ in range(10))
    return 2 * n * 4 / best


def floor(args: argparse.Namespace, batch: int, bandwidth: float) -> dict[str, float]:
    c = model_config(args.tiny)
    h, inter, layers, vocab = (
        c["hidden_size"],
        c["intermediate_size"],
        c["num_hidden_layers"],
        c["vocab_size"],
    )
    head_dim = h // c["num_attention_heads"]
    elem = 2 if args.device == "cuda" else 4
    weights = (
        layers * (2 * h * h + 2 * h * c["num_key_value_heads"] * head_dim + 3 * h * inter + 2 * h)
        + h
        + vocab * h
    ) * elem
    context = args.prompt_len + args.new_tokens / 2
    kv = 2 * layers * batch * c["num_key_value_heads"] * head_dim * context * elem
    step_s = (weights + kv) / bandwidth
    return {"weights_bytes": weights, "kv_bytes_mean": kv, "floor_tokens_per_s": batch / step_s}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="where to run (default: cuda)")
    p.add_argument("--tiny", action="store_true", help="tiny model and lengths (smoke test)")
    p.add_argument("--batches", default=None, help="comma-separated batch sizes (default: 64,256; tiny: 2,4)")
    p.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default: 128; tiny: 16)")
    p.add_argument("--new-tokens", type=int, default=None, help="new tokens per row (default: 256; tiny: 16)")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {SYSTEMS}")
    p.add_argument(
        "--profile",
        action="store_true",
        help="also profile one decode step of 'fast' at the first batch size (time and kernels per step)",
    )
    p.add_argument(
        "--grpo-steps", type=int, default=3, help="timed GRPO steps after one warm-up (default: 3)"
    )
    p.add_argument(
        "--grpo-new-tokens", type=int, default=None, help="GRPO response length (default: 128; tiny: 8)"
    )
    p.add_argument(
        "--worker-timeout", type=float, default=150, help="seconds per system process (default: 150)"
    )
    p.add_argument(
        "--out",
        default=None,
        help="result JSON (default: benchmarks/results/gpu_generate_<card: h200, h100, ...|cpu_tiny>.json)",
    )
    p.add_argument(
        "--gemm-configs",
        default="64x128w4s3",
        help="'fast' on CUDA is also timed with its projections by the split-K Triton matmul (fast_gemm), "
        "in the same process: tiles <block_n>x<block_k>w<warps>s<stages> for all projections, "
        "qkv=..,o=..,gate_up=..,down=.. per projection, best:<gpu_decode_gemm.py result> for the fastest "
        "measured, or '' to skip (default: 64x128w4s3)",
    )
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    args.batches = [int(b) for b in (args.batches or ("2,4" if args.tiny else "64,256")).split(",")]
    args.prompt_len = args.prompt_len or (16 if args.tiny else 128)
    args.new_tokens = args.new_tokens or (16 if args.tiny else 256)
    args.grpo_new_tokens = args.grpo_new_tokens or (8 if args.tiny else 128)
    if args.worker:
        worker(args)
        return
    run_all(args)


def run_all(args: argparse.Namespace) -> None:
    out = (
        Path(args.out)
        if args.out
        else RESULTS
        / (f"gpu_generate_{card()}.json" if args.device == "cuda" else "gpu_generate_cpu_tiny.json")
    )
    bw = copy_bandwidth(args.device, 0.25 if args.tiny else 2.0)
    payload: dict[str, Any] = {
        "environment": environment(),
        "model": model_config(args.tiny),
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "copy_bandwidth_Bps": bw,
        "systems": {},
        "errors": {},
        "floor": {str(b): floor(args, b, bw) for b in args.batches},
    }
    forwarded = [
        "--device",
        args.device,
        "--batches",
        ",".join(map(str, args.batches)),
        "--prompt-len",
        str(args.prompt_len),
        "--new-tokens",
        str(args.new_tokens),
        "--grpo-steps",
        str(args.grpo_steps),
        "--grpo-new-tokens",
        str(args.grpo_new_tokens),
        *(["--profile"] if args.profile else []),
        "--gemm-configs",
        args.gemm_configs,
    ]
    for name in args.systems.split(","):
        cmd = [sys.executable, __file__, "--worker", name, *forwarded, *(["--tiny"] if args.tiny else [])]
        try:
            result, proc = run_child(cmd, args.worker_timeout)
        except subprocess.TimeoutExpired:
            payload["errors"][name] = f"timed out after {args.worker_timeout} s"
            continue
        sys.stderr.write(proc.stderr[-3000:])
        if result is None:
            payload["errors"][name] = proc.stderr[-2000:]
        else:
            payload["systems"][name] = result
        summarise(payload)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(payload, indent=2, sort_keys=True))
    print(json.dumps({k: payload[k] for k in ("summary",) if k in payload}, indent=2))
    print(f"wrote {out}")


def summarise(payload: dict[str, Any]) -> None:
    """Per batch: tokens/s of every system, engine / HF-static ratio and engine / floor."""
    summary: dict[str, Any] = {}
    for name, rows in payload["systems"].items():
        for row in rows:
            if "tokens_per_s" in row:
                summary.setdefault(str(row["batch"]), {})[name] = round(row["tokens_per_s"], 1)
                if "triton_gemm_tokens_per_s" in row:
                    summary[str(row["batch"])][f"{name}_triton_gemm"] = round(
                        row["triton_gemm_tokens_per_s"], 1
                    )
            else:
                summary[name] = {k: round(v, 3) for k, v in row.items() if isinstance(v, float)}
    for b, row in summary.items():
        if b in payload["floor"] and "fast" in row:
            row["floor"] = round(payload["floor"][b]["floor_tokens_per_s"], 1)
            row["fast_over_floor"] = round(row["fast"] / row["floor"], 3)
            if "hf_static" in row:
                row["fast_over_hf_static"] = round(row["fast"] / row["hf_static"], 2)
    payload["summary"] = summary


if __name__ == "__main__":
    main()
