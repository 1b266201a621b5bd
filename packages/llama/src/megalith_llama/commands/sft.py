"""`sft`: supervised fine-tuning on multi-turn chat data with the same plugins, precision and resume as train."""

from __future__ import annotations

import argparse

from megalith_llama.commands.train import add_training_flags, run

HELP = "supervised fine-tuning on {'messages': [...]} jsonl (loss on assistant tokens only)"


def register(sub: argparse._SubParsersAction, parent: argparse.ArgumentParser) -> None:
    p = sub.add_parser("sft", parents=[parent], help=HELP, description=HELP)
    add_training_flags(p, "runs/llama-sft")
    p.add_argument(
        "--data",
        required=True,
        dest="sft_data",
        help="jsonl, one {'messages': [{'role', 'content'}, ...]} conversation per line; the "
        "tokenizer's chat template renders it and only assistant tokens (+ end token) are learned",
    )
    p.add_argument(
        "--neftune-alpha",
        type=float,
        default=0.0,
        help="NEFTune noise on input embeddings during training (Jain et al. 2023; 5 is typical, 0 = off)",
    )
    p.set_defaults(func=run)  # the same run as train: the config's sft_data selects SFT
