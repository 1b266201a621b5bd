"""`prepare`: tokenize, mix and pack inputs into memory-mapped shards."""

from __future__ import annotations

import argparse
import json

HELP = "tokenize, mix and pack jsonl/text inputs into memory-mapped shards + manifest.json"


def register(sub: argparse._SubParsersAction, parent: argparse.ArgumentParser) -> None:
    p = sub.add_parser("prepare", parents=[parent], help=HELP, description=HELP)
    p.add_argument(
        "--input", action="append", required=True, metavar="PATH[:WEIGHT]",
        help="input file (.jsonl with {'text'} or {'source','target'}; anything else is plain text) or "
        "builtin:train / builtin:heldout; repeat for several; optional :WEIGHT sets its share of the mix "
        "(give weights for all inputs or none; without weights every document is used once)",
    )  # fmt: skip
    p.add_argument("--output", required=True, help="output directory (written atomically)")
    p.add_argument(
        "--tokenizer", default=None, help="HF directory, tokenizer.json, .gguf, or 'smollm2' (default)"
    )
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per packed sequence (default 2048)")
    p.add_argument("--num-proc", type=int, default=1, help="tokenization worker processes (default 1)")
    p.add_argument("--skip-bad-lines", action="store_true", help="count malformed lines instead of failing")
    p.add_argument(
        "--document-masking", action="store_true",
        help="also store position_ids and segment_ids so attention can be limited to each document",
    )  # fmt: skip
    p.add_argument(
        "--drop-last", action="store_true",
        help="drop the last partial sequence (counted in the manifest) instead of padding it with labels -100",
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="seed of the document order and mixing (default 0)")
    p.add_argument(
        "--num-tokens", type=int, default=None, help="target mixture size in tokens, > 0 (needs weights)"
    )
    p.add_argument("--sequences-per-shard", type=int, default=8192, help="rows per shard file (default 8192)")
    p.add_argument(
        "--text-unit", choices=["paragraph", "line", "file"], default="paragraph",
        help="how plain-text files split into documents (default: blank-line separated paragraphs)",
    )  # fmt: skip
    p.add_argument(
        "--add-bos", action="store_true", help="start each document with the tokenizer's bos token"
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from megalith_llama.data import InputSpec, PrepareConfig, prepare
    from megalith_llama.io import check_output_free
    from megalith_llama.model import load_tokenizer

    config = PrepareConfig(
        inputs=tuple(InputSpec.parse(s) for s in args.input),
        seq_len=args.seq_len,
        num_proc=args.num_proc,
        skip_bad_lines=args.skip_bad_lines,
        document_masking=args.document_masking,
        last_sequence="drop" if args.drop_last else "pad",
        seed=args.seed,
        target_tokens=args.num_tokens,
        sequences_per_shard=args.sequences_per_shard,
        text_unit=args.text_unit,
        add_bos=args.add_bos,
    )
    check_output_free(args.output, args.overwrite)  # before loading and tokenizing anything
    tokenizer = load_tokenizer(args.tokenizer, args.data_dir)
    with tqdm(unit="tok", unit_scale=True, desc="tokenizing") as bar:
        result = prepare(config, tokenizer, args.output, overwrite=args.overwrite, progress=bar.update)
    m = result.manifest
    summary = {
        k: m[k] for k in ("num_sequences", "num_tokens", "num_padding_tokens", "dropped_tokens", "bad_lines")
    }
    print(json.dumps({"output": str(result.output), **summary}, indent=2))
    if m["bad_lines"]:
        print(f"skipped {m['bad_lines']} malformed line(s)")
    return 0
