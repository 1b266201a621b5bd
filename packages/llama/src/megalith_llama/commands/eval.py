"""`eval`: validation loss and perplexity on prepared shards or the built-in held-out split."""

from __future__ import annotations

import argparse
import json
from typing import Any

HELP = "validation loss / perplexity of a model on prepared shards or the built-in held-out corpus"


def register(sub: argparse._SubParsersAction, parent: argparse.ArgumentParser) -> None:
    p = sub.add_parser("eval", parents=[parent], help=HELP, description=HELP)
    p.add_argument(
        "--model", default=None, help="'smollm2' (default), a tiny config name, an HF directory or .gguf"
    )
    p.add_argument("--tokenizer", default=None, help="tokenizer override (default: the model's own)")
    p.add_argument("--data", default=None, help="prepared directory (default: built-in held-out split)")
    p.add_argument(
        "--seq-len", type=int, default=512, help="sequence length for the built-in split (default 512)"
    )
    p.add_argument("--batch-size", type=int, default=4, help="sequences per forward pass (default 4)")
    p.add_argument("--max-batches", type=int, default=None, help="stop after this many batches")
    p.add_argument("--device", default="auto", help="cpu, cuda, or auto (default)")
    p.set_defaults(func=run)


def _check_args(args: argparse.Namespace) -> None:
    from megalith.common.errors import ConfigError

    if args.batch_size <= 0:
        raise ConfigError(f"--batch-size must be > 0, got {args.batch_size}")
    if args.max_batches is not None and args.max_batches <= 0:
        raise ConfigError(f"--max-batches must be > 0, got {args.max_batches}")
    if not args.data and args.seq_len <= 0:
        raise ConfigError(f"--seq-len must be > 0, got {args.seq_len}")


def run(args: argparse.Namespace) -> int:
    _check_args(args)  # before the model is loaded
    import torch
    from torch.utils.data import Dataset
    from tqdm import tqdm

    from megalith.common.device import get_device
    from megalith_llama.dataset import PackedDataset
    from megalith_llama.eval import evaluate, heldout_sequences
    from megalith_llama.model import check_seq_len, load_model

    loaded = load_model(args.model, tokenizer=args.tokenizer, data_dir=args.data_dir)
    device = get_device(args.device).torch
    model: Any = loaded.model
    dataset: Dataset[dict[str, torch.Tensor]]
    if args.data:
        packed = PackedDataset(args.data)
        packed.check_compatible(loaded.tokenizer, model.config)
        dataset = packed
    else:
        check_seq_len(model.config, args.seq_len)
        dataset = heldout_sequences(loaded.tokenizer, args.seq_len)
    result = evaluate(model.to(device), dataset, args.batch_size, args.max_batches, device, progress=tqdm)
    print(json.dumps({"model": loaded.source, **vars(result)}, indent=2))
    return 0
