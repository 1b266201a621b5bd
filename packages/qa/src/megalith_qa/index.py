"""The chunk store: one Chroma collection (embedded `PersistentClient` or a `chroma run` server).

Every chunk carries its source name, document id and the SHA-256 of the source's raw bytes in its
metadata; that record is what makes re-ingesting an unchanged source a no-op and a changed one a
replacement, with either backend. Vectors are unit-norm and the collection uses cosine distance, so
`score = 1 - distance` is the cosine similarity.

Change detection across processes: every write through a `ChunkStore` stores a fresh random generation
marker in the collection's metadata (after the data). `sync_version()` reads that marker and the chunk
count (two cheap reads) and bumps the local `version` when either differs from what it saw last, so caches
keyed on the version also notice writes made by other processes or clients of the same collection.
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from collections.abc import Sequence
from typing import Any

from megalith.common.errors import ConfigError
from megalith.common.utils import require
from megalith_qa.config import parse_chroma_url
from megalith_qa.documents import Chunk, ScoredChunk, SourceRecord, StoredDocument

logger = logging.getLogger(__name__)
GENERATION_KEY = "megalith_qa:generation"  # collection metadata: a new random value after every write
DOC_CHUNKS_KEY = "doc_chunks"  # chunk metadata: how many chunks the chunk's document version has


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
        host, port, ssl = parse_chroma_url(chroma_url)
        try:
            return chromadb.HttpClient(host=host, port=port, ssl=ssl, settings=settings)
        except ValueError as exc:  # chromadb's "Could not connect to a Chroma server"
            raise ConfigError(f"--chroma-url {chroma_url!r}: cannot reach a Chroma server ({exc})") from exc
    if chroma_dir is None:
        raise ConfigError("either a chroma directory or a chroma URL is needed")
    os.makedirs(chroma_dir, exist_ok=True)
    return chromadb.PersistentClient(path=str(chroma_dir), settings=settings)


class ChunkStore:
    """Chunks with their embeddings in a Chroma collection, plus a monotonically increasing version.

    `version` changes on every mutation made through this object and, via `sync_version()`, on changes
    made by anyone else; caches and the BM25 index key on it.
    """

    def __init__(self, client: Any, name: str) -> None:
        self.client = client
        self.name = name
        self.collection = client.get_or_create_collection(
            name=name, embedding_function=None, metadata={"hnsw:space": "cosine"}
        )
        self._lock = threading.RLock()
        self._version = 0
        self._seen: tuple[int, str] | None = None
        self._batch = int(getattr(client, "get_max_batch_size", lambda: 1000)() or 1000)

    @property
    def version(self) -> int:
        """The local version: no I/O (the health check reads it); see `sync_version` for outside writes."""
        return self._version

    def generation(self) -> tuple[int, str]:
        """(chunk count, generation marker) as the store has them now."""
        meta = self.client.get_collection(name=self.name, embedding_function=None).metadata or {}
        return self.count(), str(meta.get(GENERATION_KEY, ""))

    def sync_version(self) -> int:
        """Look at the store; bump and return `version` if it changed since the last look (any writer)."""
        state = self.generation()
        with self._lock:
            if self._seen is not None and state != self._seen:
                self._version += 1
            self._seen = state
            return self._version

    def _mark_changed(self) -> None:
        """After a write: bump the local version and publish a fresh generation marker for other readers."""
        self._version += 1
        self._seen = None
        meta = {k: v for k, v in (self.collection.metadata or {}).items() if not k.startswith("hnsw:")}
        self.collection.modify(metadata={**meta, GENERATION_KEY: uuid.uuid4().hex})

    def count(self) -> int:
        return int(self.collection.count())

    def stored(self, doc_id: str) -> StoredDocument:
        """Chunk ids, distinct source hashes and completeness of what is stored for one document id."""
        got = self.collection.get(where={"doc_id": doc_id}, include=["metadatas"])
        metas = [m or {} for m in got["metadatas"] or []]
        ids = tuple(got["ids"])
        # chunks written before DOC_CHUNKS_KEY existed count as complete (the old writer had no marker)
        complete = all(int(m.get(DOC_CHUNKS_KEY) or len(ids)) == len(ids) for m in metas)
        return StoredDocument(ids, frozenset(str(m.get("source_hash")) for m in metas), complete)

    def records_for(self, doc_id: str) -> tuple[list[str], set[str]]:
        """(chunk ids, distinct source hashes) stored for one document id."""
        doc = self.stored(doc_id)
        return list(doc.ids), set(doc.hashes)

    def replace(self, doc_id: str, chunks: Sequence[Chunk], embeddings: Any) -> int:
        """Make `chunks` the stored version of `doc_id` (embeddings: float32 [len(chunks), dim]).

        The new chunks are written first (upsert, in batches), then the document's other chunks are
        deleted, so a reader sees the old version, both, or the new one, never neither. If writing the new
        chunks fails, those already written are removed again (best effort) and the old version stays.
        Returns the number of old chunks deleted.
        """
        with self._lock:
            old_ids = self.stored(doc_id).ids
            new_ids = [c.id for c in chunks]
            try:
                self._upsert(chunks, embeddings)
            except BaseException:
                self._rollback(sorted(set(new_ids) - set(old_ids)))
                raise
            keep = set(new_ids)
            removed = self._delete_ids([i for i in old_ids if i not in keep])
            self._mark_changed()
            return removed

    def _upsert(self, chunks: Sequence[Chunk], embeddings: Any) -> None:
        total = len(chunks)
        for start in range(0, total, self._batch):
            part = chunks[start : start + self._batch]
            self.collection.upsert(
                ids=[c.id for c in part],
                documents=[c.text for c in part],
                metadatas=[{**c.metadata(), DOC_CHUNKS_KEY: total} for c in part],
                embeddings=embeddings[start : start + len(part)],
            )

    def _rollback(self, ids: list[str]) -> None:
        """Remove the chunks of a failed replace; a failure here is logged (the next ingest repairs it)."""
        try:
            self._delete_ids(ids)
        except Exception:
            logger.exception("could not remove %d chunks of a failed replace", len(ids))

    def _delete_ids(self, ids: Sequence[str]) -> int:
        for start in range(0, len(ids), self._batch):
            self.collection.delete(ids=list(ids[start : start + self._batch]))
        return len(ids)

    def _delete_doc(self, doc_id: str) -> int:
        return self._delete_ids(self.stored(doc_id).ids)

    def delete(self, doc_id: str) -> int:
        """Remove every chunk of a document; returns how many were removed."""
        with self._lock:
            removed = self._delete_doc(doc_id)
            if removed:
                self._mark_changed()
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
