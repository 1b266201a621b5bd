"""Train a small LlamaForCausalLM with ZeRO-2 on 2 gloo processes over synthetic data.

    uv run python examples/train_zero.py                 # 2 CPU processes, ZeRO-2, fp32
    uv run python examples/train_zero.py --nproc-per-node 1 --steps 50 --stage 1

It re-launches itself through torch.distributed.run; under an existing torchrun it just joins.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

import argparse
import sys
import time


def positive(kind: type) -> object:
    """An argparse type: a number of `kind` that is > 0 (NaN refused), else a usage error naming it."""

    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not value > 0:
            raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}")
        return value

    return parse


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--nproc-per-node", type=positive(int), default=2, help="local processes to launch (default 2)"
    )
    p.add_argument("--stage", type=int, default=2, choices=[1, 2], help="ZeRO stage (default 2)")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"], help="training precision")
    p.add_argument("--steps", type=positive(int), default=30, help="optimizer steps (default 30)")
    p.add_argument(
        "--batch-size", type=positive(int), default=4, help="sequences per rank per step (default 4)"
    )
    p.add_argument("--seq-len", type=positive(int), default=64, help="tokens per sequence (default 64)")
    p.add_argument("--lr", type=positive(float), default=3e-3, help="AdamW learning rate (default 3e-3)")
    return p.parse_args(argv)


def synthetic_batch(step: int, rank: int, batch: int, seq: int, vocab: int) -> torch.Tensor:
    """A learnable toy language: each sequence counts upward modulo the vocabulary from a random start."""
    import torch

    g = torch.Generator().manual_seed(step * 1000 + rank)
    start = torch.randint(0, vocab, (batch, 1), generator=g)
    return (start + torch.arange(seq)) % vocab


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from megalith.distributed import launch, relaunch, shutdown, under_launcher

    if args.nproc_per_node > 1 and not under_launcher():
        return relaunch(args.nproc_per_node, sys.argv[1:])
    import torch
    from tqdm import tqdm
    from transformers import LlamaConfig, LlamaForCausalLM

    from megalith.booster import Booster, plan
    from megalith.booster.plugins import ZeroPlugin

    info = launch()
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=344,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=args.seq_len,
    )
    model = LlamaForCausalLM(config)
    plugin = ZeroPlugin(stage=args.stage)
    if info.rank == 0:
        print(plan(model, plugin, world_size=info.world_size, precision=args.precision))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    booster = Booster(plugin=plugin, precision=args.precision)
    model, optimizer, *_ = booster.boost(model, optimizer)
    model.train()
    bar = tqdm(range(args.steps), disable=info.rank != 0, desc=f"ZeRO-{args.stage} x{info.world_size}")
    first = last = float("nan")
    t0 = time.perf_counter()
    for step in bar:
        ids = synthetic_batch(step, info.rank, args.batch_size, args.seq_len, config.vocab_size).to(
            info.device.torch
        )
        loss = model(input_ids=ids, labels=ids).loss
        booster.backward(loss, optimizer)
        optimizer.clip_grad_by_norm(1.0)
        optimizer.step()
        optimizer.zero_grad()
        last = loss.item()
        first = last if step == 0 else first
        tokens = (step + 1) * args.batch_size * args.seq_len * info.world_size
        bar.set_postfix(loss=f"{last:.3f}", tok_s=f"{tokens / (time.perf_counter() - t0):.0f}")
    if info.rank == 0:
        print(f"loss {first:.3f} -> {last:.3f} over {args.steps} steps on {info.world_size} process(es)")
    shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
