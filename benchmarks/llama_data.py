"""Benchmark: `llama-pretrain prepare` tokens/s versus a plain `datasets.map` tokenization.

Both sides tokenize the same jsonl files (the built-in corpus's train split, repeated to
`--repeat` copies) with the same tokenizer. `prepare` also mixes, packs and writes shards; the
baseline only tokenizes (`load_dataset("json") .map(batched=True)`). The outputs are checked to
be the same documents (token sequences plus the end token, as multisets) before timing is trusted.

    uv run python benchmarks/llama_data.py [--tokenizer DIR] [--repeat 4] [--num-proc 1 2]

Writes benchmarks/results/llama_data_cpu.json (machine, versions, date, tokens/s per setting).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections import Counter
from importlib.metadata import version
from pathlib import Path

import numpy as np
from _common import write_result  # benchmarks/_common.py: environment (machine, date) + atomic write

RESULTS = Path(__file__).resolve().parent / "results" / "llama_data_cpu.json"


def write_inputs(directory: Path, repeat: int) -> list[Path]:
    from megalith_llama.corpus import builtin_documents

    docs = builtin_documents("train")
    paths = []
    for r in range(repeat):
        path = directory / f"corpus-{r}.jsonl"
        with path.open("w", encoding="utf-8") as f:
            for d in docs:
                f.write(json.dumps({"text": f"[{r}] {d.text}"}, ensure_ascii=False) + "\n")
        paths.append(path)
    return paths


def run_prepare(tokenizer, paths: list[Path], out: Path, num_proc: int) -> tuple[float, Counter]:
    from megalith_llama.data import InputSpec, PrepareConfig, prepare

    config = PrepareConfig(tuple(InputSpec(str(p)) for p in paths), seq_len=2048, num_proc=num_proc)
    start = time.perf_counter()
    result = prepare(config, tokenizer, out, overwrite=True)
    seconds = time.perf_counter() - start
    ids = np.concatenate(
        [np.load(out / f"{s['name']}.input_ids.npy").reshape(-1) for s in result.manifest["shards"]]
    )
    ids = ids[: result.manifest["num_tokens"]].tolist()
    docs, cur = Counter(), []
    for t in ids:
        cur.append(t)
        if t == tokenizer.eos_token_id:
            docs[tuple(cur)] += 1
            cur = []
    return seconds, docs


def run_datasets(tokenizer, paths: list[Path], cache: Path, num_proc: int) -> tuple[float, Counter]:
    import datasets

    datasets.disable_caching()
    datasets.disable_progress_bars()
    eos = tokenizer.eos_token_id
    start = time.perf_counter()
    ds = datasets.load_dataset(
        "json", data_files=[str(p) for p in paths], split="train", cache_dir=str(cache)
    )
    ds = ds.map(
        lambda b: {
            "input_ids": [x + [eos] for x in tokenizer(b["text"], add_special_tokens=False)["input_ids"]]
        },
        batched=True,
        num_proc=num_proc if num_proc > 1 else None,
        remove_columns=["text"],
    )
    seconds = time.perf_counter() - start
    return seconds, Counter(tuple(x) for x in ds["input_ids"])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--tokenizer", default=None, help="tokenizer (default: the converted SmolLM2 tokenizer)"
    )
    parser.add_argument("--repeat", type=int, default=4, help="copies of the corpus train split (default 4)")
    parser.add_argument("--num-proc", type=int, nargs="+", default=[1, 2], help="worker counts to compare")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    from megalith_llama.model import load_tokenizer

    tokenizer = load_tokenizer(args.tokenizer)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        paths = write_inputs(Path(tmp), args.repeat)
        for n in args.num_proc:
            t_prep, docs_prep = run_prepare(tokenizer, paths, Path(tmp) / f"out{n}", n)
            t_ds, docs_ds = run_datasets(tokenizer, paths, Path(tmp) / "hf_cache", n)
            if docs_prep != docs_ds:
                raise SystemExit(f"outputs differ at num_proc={n}: prepare and datasets.map disagree")
            tokens = sum(len(d) * c for d, c in docs_prep.items())
            rows.append({
                "num_proc": n, "tokens": tokens, "documents": sum(docs_prep.values()),
                "prepare_s": round(t_prep, 3), "datasets_map_s": round(t_ds, 3),
                "prepare_tok_per_s": round(tokens / t_prep), "datasets_map_tok_per_s": round(tokens / t_ds),
                "speedup": round(t_ds / t_prep, 3), "same_output": True,
            })  # fmt: skip
    print(f"{'num_proc':>8} {'tokens':>10} {'prepare tok/s':>14} {'datasets tok/s':>15} {'speedup':>8}")
    for r in rows:
        print(
            f"{r['num_proc']:>8} {r['tokens']:>10} {r['prepare_tok_per_s']:>14} "
            f"{r['datasets_map_tok_per_s']:>15} {r['speedup']:>7.2f}x"
        )
    packages = ["megalith-llama", "tokenizers", "transformers", "datasets", "numpy"]
    payload = {
        "benchmark": "llama_data",
        "versions": {p: version(p) for p in packages},
        "tokenizer": args.tokenizer or "SmolLM2-135M-Instruct (default)",
        "repeat": args.repeat,
        "results": rows,
    }
    path = write_result(RESULTS.name, payload)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
