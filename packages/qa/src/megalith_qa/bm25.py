"""Sparse retrieval: Okapi BM25 (bm25s) over `text.tokenize` tokens (English words, Chinese bigrams).

score(d, q) = sum_{t in q} idf(t) * tf(t,d) * (k1 + 1) / (tf(t,d) + k1 * (1 - b + b * |d| / avgdl))
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from megalith.common.utils import require
from megalith_qa.documents import ScoredChunk
from megalith_qa.text import tokenize


class BM25Index:
    """An immutable BM25 index over (ids, texts, sources); rebuilt whenever the chunk store changes."""

    def __init__(self, ids: Sequence[str], texts: Sequence[str], sources: Sequence[str]) -> None:
        self.ids, self.texts, self.sources = list(ids), list(texts), list(sources)
        self._retriever = None
        if self.ids:
            bm25s = require("bm25s")
            self._retriever = bm25s.BM25()
            corpus = [tokenize(t) or [""] for t in self.texts]
            self._retriever.index(corpus, show_progress=False)

    def __len__(self) -> int:
        return len(self.ids)

    def search(self, query: str, k: int) -> list[ScoredChunk]:
        """Top-k chunks with positive BM25 score, best first (ties broken by id for determinism)."""
        if self._retriever is None:
            return []
        tokens = [t for t in tokenize(query) if t in self._retriever.vocab_dict]
        if not tokens:
            return []
        scores = np.asarray(self._retriever.get_scores(tokens), dtype=np.float64)
        order = sorted(np.flatnonzero(scores > 0), key=lambda i: (-scores[i], self.ids[i]))[:k]
        return [
            ScoredChunk(id=self.ids[i], text=self.texts[i], source=self.sources[i], score=float(scores[i]))
            for i in order
        ]
