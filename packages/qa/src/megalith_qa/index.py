"""The chunk store: one Chroma collection (embedded `PersistentClient` or a `chroma run` server).

Every chunk carries its source name, document id and the SHA-256 of the source's raw bytes in its
metadata; that record is what makes re-ingesting an unchanged source a no-op and a changed one a
replacement, with either backend. Vectors are unit-norm and the collection uses cosine distance, so
`score = 1 - distance` is the cosine similarity.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlparse

from megalith.common.errors import ConfigError
from megalith.common.utils import require
from megalith_qa.documents import Chunk, ScoredChunk, SourceRecord

logger = logging.getLogger(__name__)


def chroma_settings() -> Any:
    """Chroma settings with anonymized telemetry off (also exported as ANONYMIZED_TELEMETRY=False)."""
    os.environ["ANONYMIZED_TELEMETRY"] = "False"
    config = require("chromadb.config")
    return config.Settings(anonymized_telemetry=False)


def make_client(chroma_dir: str | os.PathLike[str] | None = None, chroma_url: str | None = None) -> Any:
    """An embedded persistent client under `chroma_dir`, or an HTTP client for `chroma_url`."""
    chromadb = require("chromadb")
    settings = chroma_settings()
    if chroma_url:
        url = urlparse(chroma_url)
        if not url.hostname:
            raise ConfigError(f"--chroma-url {chroma_url!r} has no host")
        port = url.port or (443 if url.scheme == "https" else 8000)
        return chromadb.HttpClient(host=url.hostname, port=port, ssl=url.scheme == "https", settings=settings)
    if chroma_dir is None:
        raise ConfigError("either a chroma directory or a chroma URL is needed")
    os.makedirs(chroma_dir, exist_ok=True)
    return chromadb.PersistentClient(path=str(chroma_dir), settings=settings)


class ChunkStore:
    """Chunks with their embeddings in a Chroma collection, plus a monotonically increasing version.

    `version` changes on every mutation made through this object; caches and the BM25 index key on it.
    """

    def __init__(self, client: Any, name: str) -> None:
        self.client = client
        self.name = name
        self.collection = client.get_or_create_collection(
            name=name, embedding_function=None, metadata={"hnsw:space": "cosine"}
        )
        self._lock = threading.RLock()
        self._version = 0
        self._batch = int(getattr(client, "get_max_batch_size", lambda: 1000)() or 1000)

    @property
    def version(self) -> int:
        return self._version

    def count(self) -> int:
        return int(self.collection.count())

    def records_for(self, doc_id: str) -> tuple[list[str], set[str]]:
        """(chunk ids, distinct source hashes) stored for one document id."""
        got = self.collection.get(where={"doc_id": doc_id}, include=["metadatas"])
        hashes = {str(m.get("source_hash")) for m in got["metadatas"] or []}
        return list(got["ids"]), hashes

    def replace(self, doc_id: str, chunks: Sequence[Chunk], embeddings: Any) -> int:
        """Delete every chunk of `doc_id`, then add `chunks` (embeddings: float32 [len(chunks), dim])."""
        with self._lock:
            removed = self._delete_doc(doc_id)
            for start in range(0, len(chunks), self._batch):
                part = chunks[start : start + self._batch]
                self.collection.add(
                    ids=[c.id for c in part],
                    documents=[c.text for c in part],
                    metadatas=[c.metadata() for c in part],  # type: ignore[misc]
                    embeddings=embeddings[start : start + len(part)],
                )
            self._version += 1
            return removed

    def _delete_doc(self, doc_id: str) -> int:
        ids, _ = self.records_for(doc_id)
        for start in range(0, len(ids), self._batch):
            self.collection.delete(ids=ids[start : start + self._batch])
        return len(ids)

    def delete(self, doc_id: str) -> int:
        """Remove every chunk of a document; returns how many were removed."""
        with self._lock:
            removed = self._delete_doc(doc_id)
            if removed:
                self._version += 1
            return removed

    def all_chunks(self) -> tuple[list[str], list[str], list[dict[str, Any]]]:
        """(ids, texts, metadatas) of every stored chunk, paged through in batches."""
        ids: list[str] = []
        texts: list[str] = []
        metas: list[dict[str, Any]] = []
        total = self.count()
        for offset in range(0, total, self._batch):
            got = self.collection.get(include=["documents", "metadatas"], limit=self._batch, offset=offset)
            ids.extend(got["ids"])
            texts.extend(got["documents"] or [])
            metas.extend(dict(m) for m in got["metadatas"] or [])
        return ids, texts, metas

    def sources(self) -> list[SourceRecord]:
        """One record per stored document, sorted by source name."""
        _, _, metas = self.all_chunks()
        agg: dict[str, SourceRecord] = {}
        for m in metas:
            doc_id = str(m["doc_id"])
            prev = agg.get(doc_id)
            count = prev.chunks + 1 if prev else 1
            agg[doc_id] = SourceRecord(str(m["source"]), doc_id, str(m["source_hash"]), count)
        return sorted(agg.values(), key=lambda r: r.source)

    def get(self, ids: Sequence[str]) -> dict[str, tuple[str, dict[str, Any]]]:
        """id -> (text, metadata) for the ids that exist."""
        if not ids:
            return {}
        got = self.collection.get(ids=list(ids), include=["documents", "metadatas"])
        docs, metas = got["documents"] or [], got["metadatas"] or []
        return {i: (d, dict(m)) for i, d, m in zip(got["ids"], docs, metas)}

    def search(self, query_embedding: Any, k: int) -> list[ScoredChunk]:
        """Top-k chunks by cosine similarity to a unit query vector [dim]."""
        n = min(k, self.count())
        if n <= 0:
            return []
        res = self.collection.query(
            query_embeddings=[query_embedding], n_results=n, include=["documents", "metadatas", "distances"]
        )
        out = []
        for cid, text, meta, dist in zip(
            res["ids"][0], res["documents"][0], res["metadatas"][0], res["distances"][0]
        ):
            out.append(ScoredChunk(id=cid, text=text, source=str(meta["source"]), score=1.0 - float(dist)))
        return out
