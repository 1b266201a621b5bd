"""Tensor / sequence parallelism on CPU: communication per decoder layer per step, and step time.

    uv run python benchmarks/tp_cpu.py               # tp=1 in this process, tp=2 on 2 gloo ranks
    uv run python benchmarks/tp_cpu.py --steps 3 --seq 64

Bytes are the *logical* bytes one rank sends under ring algorithms (all-reduce 2(n-1)/n·S,
all-gather / reduce-scatter (n-1)/n·S, all-to-all (n-1)/n·S of the local tensor), counted at
megalith's tensor-parallel operators. Per layer = (2-layer model − 1-layer model), which cancels
the embedding, LM head and cross-entropy. With A = b·s·h·4 bytes (fp32), n = tp:

    none          4 all-reduces of A (f, g of attention and MLP)              8(n-1)/n · A
    split_gather  4 all-gathers + 4 reduce-scatters of A, + norm-grad sums     8(n-1)/n · A + 4(n-1)/n · 2h·4
    all_to_all    q,k,v,o all-to-alls forward and backward (A/n each, KV/H for
                  k and v), + the all-reduce of the layer's replicated grads   2(2+2·KV/H)(n-1)/n² · A + 2(n-1)/n · P·4

Writes benchmarks/results/tp_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MODES = ("none", "split_gather", "all_to_all")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--steps", type=int, default=5, help="timed training steps per configuration (after 1 warm-up)"
    )
    p.add_argument("--batch", type=int, default=4, help="sequences per step")
    p.add_argument("--seq", type=int, default=128, help="tokens per sequence (divisible by 2)")
    p.add_argument("--hidden", type=int, default=256, help="hidden size of the Llama model")
    p.add_argument("--layers", type=int, default=4, help="decoder layers of the timed model")
    p.add_argument(
        "--tp1-threads",
        type=int,
        default=1,
        help="torch threads of the tp=1 run (each tp=2 rank uses 1; more threads than free cores "
        "make OpenMP spin on a loaded machine)",
    )
    p.add_argument(
        "--partial", default="", help="internal: file where a distributed rank 0 writes its results"
    )
    return p.parse_args(argv)


def config(args: argparse.Namespace, layers: int) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=2048,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 8 // 3 // 8 * 8,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=max(256, args.seq),
        attn_implementation="sdpa",
    )


class Counter:
    """Logical bytes sent by this rank, per operator, while installed over the TP operators."""

    def __init__(self) -> None:
        self.bytes: dict[str, float] = {}

    def add(self, op: str, nbytes: float) -> None:
        self.bytes[op] = self.bytes.get(op, 0.0) + nbytes

    def install(self) -> None:
        import megalith.booster.plugins.hybrid_optim as hybrid_optim
        import megalith.tensor_parallel.comm as comm
        import megalith.tensor_parallel.sequence as sequence
        import megalith.tensor_parallel.vocab as vocab

        def wrap(fn: Any, op: str, factor: Any) -> Any:
            def counted(x: Any, group: Any, *a: Any, **kw: Any) -> Any:
                n = comm.group_size(group)
                if n > 1:
                    size = (
                        x.numel() * x.element_size()
                        if not isinstance(x, list)
                        else sum(g.numel() * g.element_size() for g in x)
                    )
                    self.add(op, factor(n) * size)
                return fn(x, group, *a, **kw)

            return counted

        gather = wrap(comm.all_gather_dim, "all_gather", lambda n: n - 1)  # input is 1/n of the output
        scatter = wrap(comm.reduce_scatter_dim, "reduce_scatter", lambda n: (n - 1) / n)
        reduce = wrap(comm.all_reduce_sum, "all_reduce", lambda n: 2 * (n - 1) / n)
        exchange = wrap(comm.all_to_all_dims, "all_to_all", lambda n: (n - 1) / n)
        comm.all_gather_dim, comm.reduce_scatter_dim, comm.all_reduce_sum = gather, scatter, reduce
        comm.all_to_all_dims = exchange
        vocab.all_reduce_sum = sequence.all_reduce_sum = reduce
        hybrid_optim._sum_over = wrap(hybrid_optim._sum_over, "grad_all_reduce", lambda n: 2 * (n - 1) / n)


def formula(mode: str, args: argparse.Namespace, n: int) -> float:
    cfg = config(args, 1)
    h, kv, heads = cfg.hidden_size, cfg.num_key_value_heads, cfg.num_attention_heads
    a = args.batch * args.seq * h * 4
    if mode == "none":
        return 8 * (n - 1) / n * a
    if mode == "split_gather":
        return 8 * (n - 1) / n * a + 2 * (n - 1) / n * 2 * h * 4
    d = h // heads
    params = h * heads * d * 2 + h * kv * d * 2 + 3 * h * cfg.intermediate_size + 2 * h
    return 2 * (2 + 2 * kv / heads) * (n - 1) / n**2 * a + 2 * (n - 1) / n * params * 4


def train(args: argparse.Namespace, layers: int, tp: int, mode: str, steps: int) -> list[float]:
    import torch
    from transformers import LlamaForCausalLM

    from megalith.booster import Booster
    from megalith.booster.plugins import HybridPlugin

    torch.manual_seed(0)
    model = LlamaForCausalLM(config(args, layers))
    booster = Booster(HybridPlugin(tp_size=tp, sp_mode=mode))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, opt, *_ = booster.boost(model, opt)
    ids = torch.randint(0, 2048, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        booster.backward(model(input_ids=ids, labels=ids).loss, opt)
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
    return times


def distributed_part(args: argparse.Namespace) -> None:
    """Under torchrun (2 ranks): per-layer bytes of one step for each mode, and tp=2 step times."""
    from megalith.distributed import launch, rank, shutdown, world_size

    launch(device="cpu")
    n = world_size()
    counter = Counter()
    counter.install()
    out: dict[str, Any] = {"tp": n, "modes": {}}
    for mode in MODES:
        per_model = []
        for layers in (1, 2):
            counter.bytes = {}
            train(args, layers, n, mode, 1)
            per_model.append(dict(counter.bytes))
        measured = {op: per_model[1].get(op, 0.0) - per_model[0].get(op, 0.0) for op in per_model[1]}
        times = train(args, args.layers, n, mode, args.steps + 1)[1:]
        out["modes"][mode] = {
            "bytes_per_layer_per_step": sum(measured.values()),
            "bytes_by_op": measured,
            "formula_bytes": formula(mode, args, n),
            "step_time_s": statistics.median(times),
        }
    if rank() == 0 and args.partial:
        Path(args.partial).write_text(json.dumps(out))
    shutdown()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from megalith.distributed import relaunch, under_launcher

    if under_launcher():
        distributed_part(args)
        return
    import torch

    torch.set_num_threads(args.tp1_threads)
    tp1 = statistics.median(train(args, args.layers, 1, "none", args.steps + 1)[1:])
    with tempfile.TemporaryDirectory() as tmp:
        partial = Path(tmp) / "tp2.json"
        argv_out = [a for a in (argv if argv is not None else sys.argv[1:])] + ["--partial", str(partial)]
        code = relaunch(2, argv_out)
        if code != 0 or not partial.exists():
            raise SystemExit(f"the 2-rank run failed (exit code {code})")
        tp2 = json.loads(partial.read_text())
    print(
        f"{'mode':14s} {'bytes/layer/step':>18s} {'formula':>14s} {'tp=2 step':>10s}   (tp=1 step {tp1:.3f}s)"
    )
    for mode, row in tp2["modes"].items():
        print(
            f"{mode:14s} {row['bytes_per_layer_per_step']:18,.0f} {row['formula_bytes']:14,.0f} "
            f"{row['step_time_s']:9.3f}s"
        )
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _common import write_result

    cfg = {k: v for k, v in vars(args).items() if k != "partial"}
    payload = {"config": cfg, "tp1_step_time_s": tp1, "tp2": tp2, "load_average_1m": os.getloadavg()[0]}
    path = write_result("tp_cpu.json", payload)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
