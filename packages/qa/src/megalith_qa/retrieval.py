"""Hybrid retrieval: dense (Chroma, cosine) + BM25 fused by weighted reciprocal rank fusion.

RRF (Cormack et al., 2009) with per-retriever weights:
    score(d) = sum_r  w_r / (k + rank_r(d))      rank_r(d) = 1 for the best hit of retriever r
A document missing from a ranking contributes 0 for that retriever. Weights are chosen per query
language ('en' / 'zh'), because BM25 on Chinese character bigrams and dense MiniLM vectors (trained
mostly on English) are not equally reliable in both languages.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from megalith.common.errors import ConfigError
from megalith_qa.config import RetrievalConfig
from megalith_qa.documents import ScoredChunk
from megalith_qa.knowledge import KnowledgeBase
from megalith_qa.text import detect_language, tokenize

MODES = ("hybrid", "dense", "bm25")
_FOLLOW_UP = re.compile(
    r"\b(it|its|this|that|they|them|those|these|he|she|him|her|one|ones|there)\b|它|这|那|其|他们|该",
    re.IGNORECASE,
)


def reciprocal_rank_fusion(
    rankings: dict[str, Sequence[ScoredChunk]], weights: dict[str, float], k: int = 60
) -> list[ScoredChunk]:
    """Fuse rankings (each best-first) into one best-first list scored by weighted RRF."""
    scores: dict[str, float] = {}
    first: dict[str, ScoredChunk] = {}
    ranks: dict[str, dict[str, int]] = {}
    for name, ranking in rankings.items():
        weight = weights.get(name, 1.0)
        for rank, hit in enumerate(ranking, start=1):
            scores[hit.id] = scores.get(hit.id, 0.0) + weight / (k + rank)
            first.setdefault(hit.id, hit)
            ranks.setdefault(hit.id, {})[name] = rank
    order = sorted(scores, key=lambda cid: (-scores[cid], cid))
    return [
        ScoredChunk(id=c, text=first[c].text, source=first[c].source, score=scores[c], ranks=ranks[c])
        for c in order
    ]


def rewrite_query(query: str, previous_questions: Sequence[str]) -> str:
    """History-aware rewrite: a follow-up (pronoun, or < 3 content words) gets the last question's terms.

    'What about its default?' after 'How does the with statement work?' becomes
    'What about its default? with statement work'. Standalone questions are returned unchanged.
    """
    if not previous_questions:
        return query
    content = tokenize(query)
    if not _FOLLOW_UP.search(query) and len(content) >= 3:
        return query
    last = previous_questions[-1]
    extra = [t for t in tokenize(last) if t not in content]
    if not extra:
        return query
    terms = last if detect_language(last) == "zh" else " ".join(extra)
    return f"{query} {terms}".strip()


@dataclass(frozen=True)
class RetrievalResult:
    """Hits best-first, with the query actually searched and the index version it was computed at."""

    query: str
    hits: tuple[ScoredChunk, ...]
    version: int
    cached: bool = False


class HybridRetriever:
    """Dense + BM25 + RRF over a KnowledgeBase, with an LRU cache keyed on (mode, query, k, index version)."""

    def __init__(self, kb: KnowledgeBase, config: RetrievalConfig | None = None) -> None:
        self.kb = kb
        self.config = config or RetrievalConfig()
        self._cache: OrderedDict[tuple[str, str, int, int], tuple[ScoredChunk, ...]] = OrderedDict()
        self._lock = threading.Lock()

    def _compute(self, query: str, mode: str, k: int, version: int) -> tuple[ScoredChunk, ...]:
        n = max(k, self.config.candidates)
        if mode == "dense":
            return tuple(self.kb.dense_search(query, k))
        if mode == "bm25":
            return tuple(self.kb.bm25_search(query, k, version))
        w = self.config.weights_for(detect_language(query))
        fused = reciprocal_rank_fusion(
            {"dense": self.kb.dense_search(query, n), "bm25": self.kb.bm25_search(query, n, version)},
            {"dense": w.dense, "bm25": w.bm25},
            self.config.rrf_k,
        )
        return tuple(fused[:k])

    def retrieve(self, query: str, k: int | None = None, mode: str = "hybrid") -> RetrievalResult:
        """Top-k chunks for `query`; a cached answer is used only if the index version still matches.

        The version is checked against the store on every call (`KnowledgeBase.sync_version`), so writes
        made by other processes to the same collection invalidate the cache and the BM25 index too.
        """
        if mode not in MODES:
            raise ConfigError(f"retrieval mode must be one of {MODES}, got {mode!r}")
        k = k or self.config.top_k
        version = self.kb.sync_version()
        key = (mode, query, k, version)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return RetrievalResult(query, self._cache[key], version, cached=True)
        hits = self._compute(query, mode, k, version)
        with self._lock:
            self._cache[key] = hits
            while len(self._cache) > self.config.cache_size:
                self._cache.popitem(last=False)
        return RetrievalResult(query, hits, version)
