"""The knowledge base: splitter + embedder + chunk store + BM25 index, kept consistent.

Ingest contract (per source name):
- same bytes as recorded (SHA-256 of the raw file)  -> 'unchanged', nothing is embedded;
- different bytes                                    -> 'replaced': new chunks added, then old ones deleted;
- new source                                         -> 'added'.
A stored version that is incomplete (an interrupted replace) never counts as unchanged. A source with no
text is refused (DataError) and a stored version of it is left as it is. Identical chunk texts inside one
source are stored once (content-hash dedup). Chunk ids are `<doc_id>:<source_hash[:12]>:<position>`, so a
new version never overwrites the chunks of the old one before it is complete.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Mapping, Sequence
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


class BadFileError(DataError):
    """A file of `KnowledgeBase.ingest_paths` that cannot be ingested (its path and why)."""


def make_chunks(doc: SourceDocument, splitter: TextSplitter) -> list[Chunk]:
    """Split a document and drop repeated chunk texts; ids are `<doc_id>:<source_hash[:12]>:<position>`."""
    doc_id = doc_id_for(doc.source)
    seen: set[str] = set()
    chunks: list[Chunk] = []
    for text in splitter.split_text(doc.text):
        digest = content_hash(text)
        if digest in seen:
            continue
        seen.add(digest)
        pos = len(chunks)
        cid = f"{doc_id}:{doc.source_hash[:12]}:{pos}"
        chunks.append(Chunk(cid, text, doc.source, doc_id, pos, doc.source_hash, detect_language(text)))
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


def expand_sources(paths: Iterable[str | Path]) -> dict[str, Path]:
    """Source name -> file for `ingest PATH...`: a file named directly is named by its file name, a file
    found under a named folder by its path relative to that folder (posix separators, e.g. `a/README.md`).
    Two different files that would get the same name are refused (DataError naming both)."""
    out: dict[str, Path] = {}
    for raw in paths:
        root = Path(raw)
        for path in expand_paths([root]):
            name = path.relative_to(root).as_posix() if root.is_dir() else path.name
            prev = out.setdefault(name, path)
            if prev.resolve() != path.resolve():
                raise DataError(
                    f"{prev} and {path} would both be stored as source {name!r}; ingest one of them"
                )
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
        """The store's local version (no I/O)."""
        return self.store.version

    def sync_version(self) -> int:
        """The store's version after checking it for writes by other processes (see `ChunkStore.sync_version`)."""
        return self.store.sync_version()

    def ingest(self, doc: SourceDocument) -> IngestResult:
        """Add, replace or skip one source according to its recorded hash (see module docstring)."""
        doc_id = doc_id_for(doc.source)
        stored = self.store.stored(doc_id)
        if stored.ids and stored.complete and stored.hashes == {doc.source_hash}:
            return IngestResult(doc.source, doc_id, "unchanged", len(stored.ids))
        chunks = make_chunks(doc, self.splitter)
        if not chunks:
            kept = "; the stored version is kept" if stored.ids else ""
            raise DataError(f"{doc.source}: no text to index{kept}")
        vectors = self.embedder.embed([c.text for c in chunks])
        self.store.replace(doc_id, chunks, vectors)
        status = "replaced" if stored.ids else "added"
        logger.info("%s %s: %d chunks", status, doc.source, len(chunks))
        return IngestResult(doc.source, doc_id, status, len(chunks))

    def ingest_many(self, docs: Sequence[SourceDocument], progress: bool = False) -> list[IngestResult]:
        bar = tqdm(docs, desc="ingest", unit="doc", disable=not progress)
        results = []
        for doc in bar:
            results.append(self.ingest(doc))
            bar.set_postfix_str(f"{doc.source[:40]} ({results[-1].status})")
        return results

    def ingest_paths(
        self, paths: Iterable[str | Path], progress: bool = False, skip_bad: bool = False
    ) -> list[IngestResult]:
        """Ingest files (and supported files under directories), named as `expand_sources` says."""
        return self.ingest_files(expand_sources(paths), progress, skip_bad)

    def ingest_files(
        self, files: Mapping[str, Path], progress: bool = False, skip_bad: bool = False
    ) -> list[IngestResult]:
        """Ingest ``files`` (source name -> file, as `expand_sources` gives them).

        Every file is read and parsed before anything is stored. One that cannot be (not UTF-8,
        malformed JSON, an unreadable PDF, no text, ...) raises `BadFileError` naming its path, and
        nothing is stored; with `skip_bad` it is left out instead, as a 'skipped' result (after the
        others) whose `error` says why."""
        docs: list[SourceDocument] = []
        skipped: list[IngestResult] = []
        for name, path in files.items():
            try:
                doc = load_bytes(name, path.read_bytes())
                if not doc.text.strip():
                    raise DataError(f"{name}: no text to index")
                docs.append(doc)
            except DataError as exc:
                reason = str(exc)
                if reason.startswith(f"{name}:"):  # the loaders name the source; name the file instead
                    reason = f"{path}{reason[len(name) :]}"
                if not skip_bad:
                    raise BadFileError(reason) from exc
                skipped.append(IngestResult(name, doc_id_for(name), "skipped", 0, reason))
        return self.ingest_many(docs, progress=progress) + skipped

    def delete(self, key: str) -> int:
        """Delete a document by its id or by its source name; returns the number of chunks removed."""
        removed = self.store.delete(key)
        return removed or self.store.delete(doc_id_for(key))

    def sources(self) -> list[SourceRecord]:
        return self.store.sources()

    def bm25(self, version: int | None = None) -> BM25Index:
        """The BM25 index of store version `version` (default: checked now); rebuilt lazily after any change."""
        if version is None:
            version = self.store.sync_version()
        with self._lock:
            if self._bm25 is None or self._bm25_version != version:
                ids, texts, metas = self.store.all_chunks()
                self._bm25 = BM25Index(ids, texts, [str(m["source"]) for m in metas])
                self._bm25_version = version
            return self._bm25

    def dense_search(self, query: str, k: int) -> list[ScoredChunk]:
        return self.store.search(self.embedder.embed([query])[0], k)

    def bm25_search(self, query: str, k: int, version: int | None = None) -> list[ScoredChunk]:
        return self.bm25(version).search(query, k)
