"""`chat`: streaming terminal chat with a model."""

from __future__ import annotations

import argparse
import sys
from typing import Any

HELP = "streaming terminal chat (type /exit or press Ctrl-D to leave)"


def register(sub: argparse._SubParsersAction, parent: argparse.ArgumentParser) -> None:
    p = sub.add_parser("chat", parents=[parent], help=HELP, description=HELP)
    p.add_argument(
        "--model", default=None, help="'smollm2' (default), a tiny config name, an HF directory or .gguf"
    )
    p.add_argument("--tokenizer", default=None, help="tokenizer override (default: the model's own)")
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument("--max-new-tokens", type=int, default=256, help="reply length limit (default 256)")
    p.add_argument(
        "--temperature", type=float, default=0.7, help="sampling temperature; 0 = greedy (default 0.7)"
    )
    p.add_argument("--top-p", type=float, default=0.9, help="nucleus sampling mass (default 0.9)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--device", default="auto", help="cpu, cuda, or auto (default)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from megalith.common.device import get_device
    from megalith_llama.chat import ChatConfig, chat_loop
    from megalith_llama.model import load_model

    config = ChatConfig(args.max_new_tokens, args.temperature, args.top_p, args.system, args.seed)
    loaded = load_model(args.model, tokenizer=args.tokenizer, data_dir=args.data_dir)
    model: Any = loaded.model
    model = model.to(get_device(args.device).torch)
    chat_loop(model, loaded.tokenizer, config, sys.stdin, sys.stdout)
    return 0
