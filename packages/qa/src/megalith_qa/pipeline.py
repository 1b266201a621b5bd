"""Retrieve + generate: the one object the server and the CLI talk to.

question --(history-aware rewrite)--> query --(hybrid retrieval)--> top-k chunks
         --(generator, with the session's memory)--> answer + citations (source, chunk id, score, snippet)
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Generator as PyGenerator
from dataclasses import dataclass
from pathlib import Path

from megalith_qa.config import QAConfig
from megalith_qa.documents import IngestResult, ScoredChunk
from megalith_qa.embedding import Embedder, make_embedder
from megalith_qa.index import ChunkStore, make_client
from megalith_qa.ingest import TextSplitter, builtin_documents
from megalith_qa.knowledge import KnowledgeBase
from megalith_qa.llm import GenerationRequest, GenerationStream, Generator, finish_reason_of, make_generator
from megalith_qa.memory import ConversationMemory
from megalith_qa.retrieval import HybridRetriever, RetrievalResult, rewrite_query

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Citation:
    source: str
    chunk_id: str
    score: float
    snippet: str


@dataclass(frozen=True)
class Answer:
    """`finish_reason` is "length" when `max_new_tokens` cut the answer short, else "stop"."""

    text: str
    citations: tuple[Citation, ...]
    session_id: str
    query: str
    finish_reason: str = "stop"


def citations_of(hits: tuple[ScoredChunk, ...], snippet_chars: int = 240) -> tuple[Citation, ...]:
    return tuple(Citation(h.source, h.id, round(h.score, 6), h.text[:snippet_chars]) for h in hits)


class QAPipeline:
    """Ties a knowledge base, a hybrid retriever, a generator and per-session memory together."""

    def __init__(self, kb: KnowledgeBase, generator: Generator, config: QAConfig | None = None) -> None:
        self.config = config or QAConfig()
        self.kb = kb
        self.retriever = HybridRetriever(kb, self.config.retrieval)
        self.generator = generator
        self.memory = ConversationMemory(self.config.memory_tokens)

    @staticmethod
    def new_session_id() -> str:
        return uuid.uuid4().hex

    def prepare(
        self, question: str, session_id: str, k: int | None = None, max_new_tokens: int | None = None
    ) -> tuple[GenerationRequest, RetrievalResult]:
        """Rewrite the question with this session's history, retrieve, and build the generation request."""
        query = rewrite_query(question, self.memory.questions(session_id))
        result = self.retriever.retrieve(query, k=k)
        request = GenerationRequest(
            question=question,
            contexts=result.hits,
            history=self.memory.render(session_id),
            max_new_tokens=max_new_tokens or self.config.server.max_new_tokens,
        )
        return request, result

    def record(self, session_id: str, question: str, answer: str) -> None:
        self.memory.add(session_id, "user", question)
        self.memory.add(session_id, "assistant", answer)

    def answer(
        self,
        question: str,
        session_id: str | None = None,
        k: int | None = None,
        max_new_tokens: int | None = None,
    ) -> Answer:
        sid = session_id or self.new_session_id()
        request, result = self.prepare(question, sid, k, max_new_tokens)
        pieces = self.generator.stream(request)
        text = "".join(pieces).strip()
        self.record(sid, question, text)
        return Answer(text, citations_of(result.hits), sid, result.query, finish_reason_of(pieces))

    def stream(
        self, question: str, session_id: str, k: int | None = None, max_new_tokens: int | None = None
    ) -> tuple[tuple[Citation, ...], GenerationStream]:
        """Citations now, answer pieces lazily (a `GenerationStream`, whose `finish_reason` is final once it
        is exhausted); the turn is recorded when the stream is exhausted. Closing the stream closes the
        generator's (a client that went away stops the generation)."""
        request, result = self.prepare(question, session_id, k, max_new_tokens)
        inner = self.generator.stream(request)  # lazy: nothing runs before the first piece is asked for
        close_inner = getattr(inner, "close", None)

        def pieces() -> PyGenerator[str, None, str]:
            parts: list[str] = []
            for piece in inner:
                parts.append(piece)
                yield piece
            self.record(session_id, question, "".join(parts).strip())
            return finish_reason_of(inner)

        return citations_of(result.hits), GenerationStream(pieces(), on_close=close_inner)

    def ingest_builtin(self, progress: bool = False) -> list[IngestResult]:
        """Python's documentation topics and the project's READMEs (unchanged ones are skipped)."""
        start = time.perf_counter()
        results = self.kb.ingest_many(builtin_documents(), progress=progress)
        changed = sum(r.status != "unchanged" for r in results)
        logger.info(
            "built-in knowledge base: %d sources, %d (re)embedded in %.1fs",
            len(results),
            changed,
            time.perf_counter() - start,
        )
        return results


def collection_name(config: QAConfig, embedder: Embedder) -> str:
    """`<collection>-<embedder name>`: vectors of different embedders never share a collection."""
    return f"{config.collection}-{embedder.name}"


def build_knowledge_base(config: QAConfig, embedder: Embedder) -> KnowledgeBase:
    client = make_client(config.chroma_dir, config.chroma_url)
    store = ChunkStore(client, collection_name(config, embedder))
    return KnowledgeBase(store, embedder, TextSplitter(config.chunking))


def build_pipeline(
    config: QAConfig, embedder: Embedder | str = "minilm", generator: Generator | None = None
) -> QAPipeline:
    emb = make_embedder(embedder) if isinstance(embedder, str) else embedder
    kb = build_knowledge_base(config, emb)
    gen = generator or make_generator(
        config.llm, Path(config.data_dir) / "models", no_repeat_ngram=config.server.no_repeat_ngram
    )
    return QAPipeline(kb, gen, config)
