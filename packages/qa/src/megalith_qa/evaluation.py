"""Retrieval evaluation on the shipped question set (questions about Python's documentation topics).

For a question with relevant sources R (its topic, plus any alternates) and retrieved chunks c_1..c_10:
    hit@k   = 1 if any c_i (i <= k) comes from R else 0
    RR      = 1 / (first i with c_i from R), 0 if none within 10     (MRR is its mean)
    nDCG@10 = sum_i rel_i / log2(i + 1)  /  sum_{i <= min(10, |rel chunks in index|)} 1 / log2(i + 1)
with binary chunk relevance rel_i. Figures are means over questions, per retrieval mode.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path

from tqdm import tqdm

from megalith.checkpoint import atomic
from megalith.common.errors import DataError
from megalith_qa.ingest.builtin import PYDOC_PREFIX
from megalith_qa.retrieval import MODES, HybridRetriever

KS = (1, 5, 10)


@dataclass(frozen=True)
class EvalItem:
    question: str
    relevant: frozenset[str]  # source names


@dataclass(frozen=True)
class ModeScores:
    mode: str
    hit_at_1: float
    hit_at_5: float
    hit_at_10: float
    mrr: float
    ndcg_at_10: float
    questions: int


def load_eval_set(path: Path | None = None) -> list[EvalItem]:
    """JSON lines {"question", "topic", "also"?}; the shipped set when `path` is None."""
    if path is None:
        text = resources.files("megalith_qa").joinpath("data/eval_set.jsonl").read_text(encoding="utf-8")
        name = "eval_set.jsonl"
    else:
        name = str(path)
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise DataError(f"{name}: cannot read the evaluation set ({exc})") from exc
    items = []
    for lineno, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            topics = [row["topic"], *row.get("also", [])]
            items.append(EvalItem(row["question"], frozenset(f"{PYDOC_PREFIX}{t}" for t in topics)))
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise DataError(f"{name}:{lineno}: bad evaluation row ({exc})") from exc
    return items


def hit_at(sources: Sequence[str], relevant: frozenset[str], k: int) -> float:
    return 1.0 if any(s in relevant for s in sources[:k]) else 0.0


def reciprocal_rank(sources: Sequence[str], relevant: frozenset[str]) -> float:
    for i, s in enumerate(sources, start=1):
        if s in relevant:
            return 1.0 / i
    return 0.0


def ndcg(sources: Sequence[str], relevant: frozenset[str], n_relevant: int, k: int = 10) -> float:
    dcg = sum(1.0 / math.log2(i + 1) for i, s in enumerate(sources[:k], start=1) if s in relevant)
    ideal = sum(1.0 / math.log2(i + 1) for i in range(1, min(k, n_relevant) + 1))
    return dcg / ideal if ideal > 0 else 0.0


def evaluate(
    retriever: HybridRetriever,
    items: Sequence[EvalItem],
    modes: Sequence[str] = MODES,
    progress: bool = False,
) -> list[ModeScores]:
    """Score each retrieval mode on `items` (top 10 chunks per question)."""
    counts = {r.source: r.chunks for r in retriever.kb.sources()}
    out = []
    for mode in modes:
        sums = dict.fromkeys(("h1", "h5", "h10", "rr", "ndcg"), 0.0)
        for item in tqdm(items, desc=f"eval {mode}", disable=not progress):
            sources = [h.source for h in retriever.retrieve(item.question, k=10, mode=mode).hits]
            n_rel = sum(counts.get(s, 0) for s in item.relevant)
            sums["h1"] += hit_at(sources, item.relevant, 1)
            sums["h5"] += hit_at(sources, item.relevant, 5)
            sums["h10"] += hit_at(sources, item.relevant, 10)
            sums["rr"] += reciprocal_rank(sources, item.relevant)
            sums["ndcg"] += ndcg(sources, item.relevant, n_rel)
        n = max(len(items), 1)
        out.append(
            ModeScores(
                mode,
                sums["h1"] / n,
                sums["h5"] / n,
                sums["h10"] / n,
                sums["rr"] / n,
                sums["ndcg"] / n,
                len(items),
            )
        )
    return out


def format_table(scores: Sequence[ModeScores]) -> str:
    header = f"{'mode':<8} {'hit@1':>7} {'hit@5':>7} {'hit@10':>7} {'MRR':>7} {'nDCG@10':>8}"
    rows = [
        f"{s.mode:<8} {s.hit_at_1:>7.3f} {s.hit_at_5:>7.3f} {s.hit_at_10:>7.3f} {s.mrr:>7.3f} {s.ndcg_at_10:>8.3f}"
        for s in scores
    ]
    return "\n".join([header, "-" * len(header), *rows])


def to_json(scores: Sequence[ModeScores], extra: dict[str, object] | None = None) -> dict[str, object]:
    return {"modes": {s.mode: asdict(s) for s in scores}, **(extra or {})}


def write_json(path: Path, data: object) -> None:
    """Write `data` as indented JSON atomically: a temporary file beside `path`, flushed to disk, then
    `os.replace`d over it, so neither a reader nor a crash ever sees a half-written file."""
    atomic.write_text(path, json.dumps(data, indent=2) + "\n")
