"""The knowledge base: splitter + embedder + chunk store + BM25 index, kept consistent.

Ingest contract (per source name):
- same bytes as recorded (SHA-256 of the raw file)  -> 'unchanged', nothing is embedded;
- different bytes                                    -> 'replaced', old chunks deleted, new ones added;
- new source                                         -> 'added'.
Identical chunk texts inside one source are stored once (content-hash dedup).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path

from tqdm import tqdm

from megalith.common.errors import DataError
from megalith_qa.bm25 import BM25Index
from megalith_qa.documents import (
    Chunk,
    IngestResult,
    ScoredChunk,
    SourceDocument,
    SourceRecord,
    content_hash,
    doc_id_for,
)
from megalith_qa.embedding import Embedder
from megalith_qa.index import ChunkStore
from megalith_qa.ingest.loaders import SUPPORTED_TYPES, file_kind, load_bytes
from megalith_qa.ingest.splitter import TextSplitter
from megalith_qa.text import detect_language

logger = logging.getLogger(__name__)


def make_chunks(doc: SourceDocument, splitter: TextSplitter) -> list[Chunk]:
    """Split a document and drop repeated chunk texts; ids are `<doc_id>:<position>`."""
    doc_id = doc_id_for(doc.source)
    seen: set[str] = set()
    chunks: list[Chunk] = []
    for text in splitter.split_text(doc.text):
        digest = content_hash(text)
        if digest in seen:
            continue
        seen.add(digest)
        pos = len(chunks)
        chunks.append(
            Chunk(f"{doc_id}:{pos}", text, doc.source, doc_id, pos, doc.source_hash, detect_language(text))
        )
    return chunks


def expand_paths(paths: Iterable[str | Path]) -> list[Path]:
    """Files named directly, plus supported files found (recursively) under named directories."""
    out: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            out.extend(
                p
                for p in sorted(path.rglob("*"))
                if p.is_file() and p.suffix.lstrip(".").lower() in SUPPORTED_TYPES
            )
        elif path.is_file():
            file_kind(path.name)
            out.append(path)
        else:
            raise DataError(f"{path}: no such file or directory")
    return out


class KnowledgeBase:
    """Ingest, delete, and search (dense and BM25) one collection of chunks."""

    def __init__(self, store: ChunkStore, embedder: Embedder, splitter: TextSplitter) -> None:
        self.store, self.embedder, self.splitter = store, embedder, splitter
        self._bm25: BM25Index | None = None
        self._bm25_version = -1
        self._lock = threading.Lock()

    @property
    def version(self) -> int:
        return self.store.version

    def ingest(self, doc: SourceDocument) -> IngestResult:
        """Add, replace or skip one source according to its recorded hash (see module docstring)."""
        doc_id = doc_id_for(doc.source)
        old_ids, old_hashes = self.store.records_for(doc_id)
        if old_ids and old_hashes == {doc.source_hash}:
            return IngestResult(doc.source, doc_id, "unchanged", len(old_ids))
        chunks = make_chunks(doc, self.splitter)
        if not chunks and not old_ids:
            raise DataError(f"{doc.source}: no text to index")
        vectors = self.embedder.embed([c.text for c in chunks])
        self.store.replace(doc_id, chunks, vectors)
        status = "replaced" if old_ids else "added"
        logger.info("%s %s: %d chunks", status, doc.source, len(chunks))
        return IngestResult(doc.source, doc_id, status, len(chunks))

    def ingest_many(self, docs: Sequence[SourceDocument], progress: bool = False) -> list[IngestResult]:
        bar = tqdm(docs, desc="ingest", unit="doc", disable=not progress)
        results = []
        for doc in bar:
            results.append(self.ingest(doc))
            bar.set_postfix_str(f"{doc.source[:40]} ({results[-1].status})")
        return results

    def ingest_paths(self, paths: Iterable[str | Path], progress: bool = False) -> list[IngestResult]:
        """Ingest files (and supported files under directories); the source name is the file name."""
        files = expand_paths(paths)
        return self.ingest_many([load_bytes(p.name, p.read_bytes()) for p in files], progress=progress)

    def delete(self, key: str) -> int:
        """Delete a document by its id or by its source name; returns the number of chunks removed."""
        removed = self.store.delete(key)
        return removed or self.store.delete(doc_id_for(key))

    def sources(self) -> list[SourceRecord]:
        return self.store.sources()

    def bm25(self) -> BM25Index:
        """The BM25 index of the current store version (rebuilt lazily after any change)."""
        with self._lock:
            if self._bm25 is None or self._bm25_version != self.store.version:
                version = self.store.version
                ids, texts, metas = self.store.all_chunks()
                self._bm25 = BM25Index(ids, texts, [str(m["source"]) for m in metas])
                self._bm25_version = version
            return self._bm25

    def dense_search(self, query: str, k: int) -> list[ScoredChunk]:
        return self.store.search(self.embedder.embed([query])[0], k)

    def bm25_search(self, query: str, k: int) -> list[ScoredChunk]:
        return self.bm25().search(query, k)
