"""Interleaved A/B of training-step variants at the 1.1B TinyLlama shape (see gpu_train.py).

Step times on one H200 drift by a few percent between runs and hosts, so small levers are judged
here: every variant runs in a fresh process, the variants take turns for ``--rounds`` rounds, and
the summary gives each variant's mean tokens/s and its ratio to the mean of ``hf_liger`` measured
in between. Variants:

- ``hf_liger`` / ``megalith``: the systems of gpu_train.py;
- ``megalith_ce<N>``: megalith with the fused cross-entropy's logits chunk fixed at N rows
  (the default is `megalith.kernels.custom_ops.chunk_rows`: 4096 rows at this shape);
- ``megalith_nocache``: megalith with ``use_cache=False`` in every loss forward (HF's default
  builds a KV cache in training forwards too; skipping it was measured slower, see the core README);
- ``megalith_graphs``: megalith with Inductor's CUDA graphs (``triton.cudagraphs``, what
  ``torch.compile(mode="reduce-overhead")`` turns on) for the compiled forward and backward;
- ``megalith_cdt``: megalith with Inductor's coordinate-descent tuning of its generated kernels
  (``TORCHINDUCTOR_COORDINATE_DESCENT_TUNING=1``: the residual adds, norms and casts the compiler
  writes, about a tenth of the step, get their block sizes searched; longer warm-up);
- ``*_expandable``: the same with ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``;
- ``megalith_torchadam``: megalith with torch's ``AdamW(fused=True, capturable=True)`` instead of
  `megalith.kernels.FusedAdamW`;
- ``*_stepgraph``: the whole step (forward, backward, optimizer step) captured in one
  ``torch.cuda.CUDAGraph`` after three eager steps on a side stream and replayed on a static input
  batch (``megalith_stepgraph``: with ``FusedAdamW(multi_tensor=True, capturable=True)``).

    python benchmarks/gpu_train_ab.py --variants hf_liger megalith megalith_ce2048 --rounds 2
    python benchmarks/gpu_train_ab.py --device cpu --tiny --rounds 1   # smoke test
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from pathlib import Path
from statistics import mean
from typing import Any, NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_train
from _common import emit_result, result_name, run_child, write_result

EXPANDABLE = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
COORDINATE_DESCENT = {"TORCHINDUCTOR_COORDINATE_DESCENT_TUNING": "1"}
VARIANT = re.compile(
    r"^(hf_liger|megalith)(?:_ce(\d+))?(_nocache)?(_graphs)?(_cdt)?(_torchadam)?(_stepgraph)?(_expandable)?$"
)


class Variant(NamedTuple):
    system: str  # a system of gpu_train.py
    chunk_rows: int | None  # the fused cross-entropy's logits chunk, None: its default
    no_cache: bool  # use_cache=False in every loss forward
    graphs: bool  # Inductor's CUDA graphs around the compiled forward and backward
    env: dict[str, str]  # added to the process environment
    torch_adam: bool = False  # torch AdamW(fused, capturable) instead of FusedAdamW
    step_graph: bool = False  # the whole step in one CUDA graph (capturable optimizer)


def parse_variant(name: str) -> Variant:
    """What a variant name asks for; an unknown name is an ArgumentTypeError naming it."""
    match = VARIANT.match(name)
    if match is None or (match.group(1) == "hf_liger" and any(match.group(i) for i in (2, 3, 4, 5, 6, 7))):
        raise argparse.ArgumentTypeError(
            f"unknown variant {name!r}: use hf_liger[_expandable] or "
            "megalith[_ce<rows>][_nocache][_graphs][_cdt][_torchadam][_stepgraph][_expandable]"
        )
    rows = int(match.group(2)) if match.group(2) else None
    if rows == 0:
        raise argparse.ArgumentTypeError(f"variant {name!r}: the chunk must have at least one row")
    env = (COORDINATE_DESCENT if match.group(5) else {}) | (EXPANDABLE if match.group(8) else {})
    return Variant(
        match.group(1), rows, bool(match.group(3)), bool(match.group(4)), env,
        bool(match.group(6)), bool(match.group(7)),
    )  # fmt: skip


def child(name: str, args: argparse.Namespace) -> dict[str, Any]:
    variant = parse_variant(name)
    if variant.chunk_rows is not None:
        from megalith.kernels import custom_ops

        rows = variant.chunk_rows
        custom_ops.chunk_rows = lambda tokens, vocab, hidden: min(tokens, rows)
    if variant.no_cache:
        from megalith.policies import kernels

        loss_forward = kernels._causal_lm_forward
        kernels._causal_lm_forward = lambda self, *a, **kw: loss_forward(
            self, *a, **{"use_cache": False, **kw}
        )
    if variant.torch_adam or variant.step_graph:
        _patch_step(variant.torch_adam, variant.step_graph)
    if variant.graphs:
        import torch._inductor.config as inductor_config
        from torch._dynamo.utils import counters

        inductor_config.triton.cudagraphs = True
        row = gpu_train.child(variant.system, args)
        return {"variant": name, **row, "cudagraph_skips": dict(counters["inductor"])}
    return {"variant": name, **gpu_train.child(variant.system, args)}


def _patch_step(torch_adam: bool, step_graph: bool) -> None:
    """Make gpu_train's megalith system step with torch's fused capturable AdamW (`torch_adam`) or
    a capturable FusedAdamW, and with `step_graph` replay the whole step from one CUDA graph."""
    import torch

    import megalith.kernels

    fused = megalith.kernels.FusedAdamW
    megalith.kernels.FusedAdamW = (  # type: ignore[misc]
        (
            lambda params, multi_tensor=False, **kw: torch.optim.AdamW(
                params, fused=True, capturable=True, **kw
            )
        )
        if torch_adam
        else (lambda params, **kw: fused(params, capturable=True, **kw))
    )
    build = gpu_train._megalith

    def graphed(*a: Any, **kw: Any) -> tuple[Any, Any, Any]:
        model, step, info = build(*a, **kw)
        name = "torch AdamW(fused, capturable)" if torch_adam else info["optimizer"] + " (capturable)"
        info = info | {"optimizer": name, "step_graph": step_graph}
        if not step_graph:
            return model, step, info
        captured: dict[str, Any] = {}

        def replay(ids: torch.Tensor) -> Any:
            if not captured:
                captured["ids"] = ids.clone()
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(3):
                        step(captured["ids"])
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    captured["loss"] = step(captured["ids"], zero=False)
                captured["graph"] = graph
            captured["ids"].copy_(ids)
            captured["graph"].replay()
            return captured["loss"]

        return model, replay, info

    gpu_train._megalith = graphed


def run_rounds(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every variant once per round, each in a fresh process; the rows in run order."""
    forwarded = ["--device", args.device, "--warmup", str(args.warmup), "--steps", str(args.steps)]
    forwarded += ["--tiny"] if args.tiny else []
    runs: list[dict[str, Any]] = []
    for turn in range(args.rounds):
        for name in args.variants:
            env = os.environ | parse_variant(name).env
            cmd = [sys.executable, __file__, "--child", name, *forwarded]
            t0 = time.perf_counter()
            row, proc = run_child(cmd, args.timeout, env)
            if row is None:
                raise SystemExit(f"variant {name} failed:\n{(proc.stderr or proc.stdout)[-3000:]}")
            runs.append(row | {"round": turn, "wall_s": time.perf_counter() - t0})
            mem = f"{row['peak_mem_GiB']:.2f} GiB" if row["peak_mem_GiB"] is not None else "-"
            print(f"round {turn}  {name:24s} {row['tokens_per_s']:9.0f} tok/s  peak {mem}", flush=True)
    return runs


def summarize(variants: list[str], runs: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Mean tokens/s per variant and, when hf_liger ran, the ratio to its mean."""
    summary = {
        v: {"tokens_per_s": mean(r["tokens_per_s"] for r in runs if r["variant"] == v)} for v in variants
    }
    base = summary.get("hf_liger", {}).get("tokens_per_s")
    for name, s in summary.items():
        if base:
            s["vs_hf_liger"] = s["tokens_per_s"] / base
        ratio = f"  {s['vs_hf_liger']:.3f}x hf_liger" if base else ""
        print(f"mean {name:24s} {s['tokens_per_s']:9.0f} tok/s{ratio}")
    return summary


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for name in args.variants:
        try:
            parse_variant(name)
        except argparse.ArgumentTypeError as err:
            parser.error(str(err))
    if args.device != "cuda" and any(name.startswith("hf_liger") for name in args.variants):
        parser.error(
            "hf_liger variants need a GPU (Liger-Kernel is Triton-only); on CPU compare megalith variants"
        )
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--variants", nargs="+", type=str, default=["hf_liger", "megalith", "megalith_ce2048"],
                        help="variants to compare (default: hf_liger megalith megalith_ce2048)")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=2, help="turns every variant takes (default 2)")
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--tiny", action="store_true", help="tiny model for a CPU smoke test")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per process (default 3)")
    parser.add_argument("--steps", type=int, default=12, help="timed steps per process (default 12)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per variant process")
    parser.add_argument("--out", default=None, help="result file under benchmarks/results/")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not args.child:
        check_args(parser, args)
    args.batch, args.seq = (2, 32) if args.tiny else (8, 2048)
    args.kernels, args.multi_tensor, args.profile = None, False, False
    if args.child:
        emit_result(child(args.child, args))
        return
    runs = run_rounds(args)
    summary = summarize(args.variants, runs)
    out = args.out or result_name("gpu_train_ab", args.device)
    payload = {
        "rounds": args.rounds,
        "warmup": args.warmup,
        "steps": args.steps,
        "summary": summary,
        "runs": runs,
    }
    print(f"wrote {write_result(out, payload)}")


if __name__ == "__main__":
    main()
