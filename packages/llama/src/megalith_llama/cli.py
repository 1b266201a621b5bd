"""Command line of megalith-llama: `python -m megalith_llama.cli <command> [options]`.

Every command lives in its own module that exposes `register(subparsers)`; the module adds its
sub-parser and sets `func=run`, where `run(args) -> int` is the exit code. To add a command
(e.g. `train` in `megalith_llama/train.py`), write `register`/`run` there and append the module
name to `COMMAND_MODULES`. Modules keep heavy imports inside `run` so `--help` stays fast (and
spawned worker processes, which re-import the main module, start quickly).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

from megalith.common.errors import MegalithError
from megalith.common.logging import configure_logging
from megalith_llama.paths import DATA_DIR_ENV, DEFAULT_DATA_DIR

COMMAND_MODULES: tuple[str, ...] = (
    "megalith_llama.commands.train",
    "megalith_llama.commands.sft",
    "megalith_llama.commands.prepare",
    "megalith_llama.commands.expand_vocab",
    "megalith_llama.commands.eval",
    "megalith_llama.commands.chat",
    "megalith_llama.commands.convert",
)


def common_parser() -> argparse.ArgumentParser:
    """Options every command accepts (add it as a parent of each sub-parser)."""
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument(
        "--data-dir",
        default=None,
        help=f"where converted models are cached (default: ${DATA_DIR_ENV} or {DEFAULT_DATA_DIR})",
    )
    parent.add_argument(
        "--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="logging verbosity"
    )
    return parent


def build_parser(modules: Sequence[str] = COMMAND_MODULES) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llama-pretrain",
        description="LLaMA continual pretraining, data preparation, vocabulary expansion, SFT, evaluation and chat "
        "on megalith. With no command, runs `train` on its built-in defaults.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    parent = common_parser()
    for name in modules:
        importlib.import_module(name).register(sub, parent)
    return parser


DEFAULT_COMMAND = "train"


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
        argv = [DEFAULT_COMMAND, *argv]  # `llama-pretrain [train flags]` runs the default command
    args = build_parser().parse_args(argv)
    args.argv = argv  # what a re-launch under torch.distributed.run passes on
    configure_logging(getattr(logging, args.log_level))
    try:
        return int(args.func(args))
    except MegalithError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
