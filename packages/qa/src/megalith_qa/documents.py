"""Messages that flow through ingestion and retrieval: frozen dataclasses, never bare tuples."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field


def content_hash(data: bytes | str) -> str:
    """SHA-256 hex digest of the bytes (strings are UTF-8 encoded)."""
    raw = data.encode("utf-8") if isinstance(data, str) else data
    return hashlib.sha256(raw).hexdigest()


def doc_id_for(source: str) -> str:
    """Stable document id of a source name: first 16 hex digits of its SHA-256."""
    return content_hash(source)[:16]


@dataclass(frozen=True)
class SourceDocument:
    """One loaded source: its name (file name or `pydoc:topic`), plain text and the hash of its raw bytes."""

    source: str
    text: str
    source_hash: str
    kind: str = "txt"


@dataclass(frozen=True)
class Chunk:
    """A piece of a source as stored in the index. `id` is `<doc_id>:<position>`."""

    id: str
    text: str
    source: str
    doc_id: str
    position: int
    source_hash: str
    language: str = "en"

    def metadata(self) -> dict[str, str | int]:
        return {
            "source": self.source,
            "doc_id": self.doc_id,
            "position": self.position,
            "source_hash": self.source_hash,
            "chunk_hash": content_hash(self.text)[:16],
            "language": self.language,
        }


@dataclass(frozen=True)
class ScoredChunk:
    """A retrieved chunk with the score of the retriever that produced it (higher is better)."""

    id: str
    text: str
    source: str
    score: float
    ranks: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class SourceRecord:
    """What the index remembers of an ingested source."""

    source: str
    doc_id: str
    source_hash: str
    chunks: int


@dataclass(frozen=True)
class StoredDocument:
    """What the store holds under one document id: its chunk ids, the distinct source hashes they record, and
    whether they are exactly one complete version (every chunk records its version's chunk count)."""

    ids: tuple[str, ...]
    hashes: frozenset[str]
    complete: bool


@dataclass(frozen=True)
class IngestResult:
    """Outcome of ingesting one source: 'added', 'replaced', 'unchanged', or 'skipped' (a file that
    `KnowledgeBase.ingest_paths(skip_bad=True)` left out; `error` says why)."""

    source: str
    doc_id: str
    status: str
    chunks: int
    error: str = ""
