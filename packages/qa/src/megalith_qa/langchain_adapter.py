"""LangChain integration: the hybrid retriever as a `langchain_core` `BaseRetriever`, and chunks as
LangChain `Document`s, so the retriever plugs into user chains. langchain-core is imported lazily."""

from __future__ import annotations

from typing import Any

from megalith.common.utils import require
from megalith_qa.documents import ScoredChunk
from megalith_qa.retrieval import HybridRetriever


def to_langchain_document(hit: ScoredChunk) -> Any:
    """A `langchain_core.documents.Document` with source, chunk id and score in its metadata."""
    documents = require("langchain_core.documents")
    return documents.Document(
        page_content=hit.text,
        metadata={"source": hit.source, "chunk_id": hit.id, "score": hit.score},
        id=hit.id,
    )


def as_langchain_retriever(retriever: HybridRetriever, k: int = 5, mode: str = "hybrid") -> Any:
    """Wrap `retriever` as a LangChain `BaseRetriever` (`.invoke(query) -> list[Document]`)."""
    # an optional dependency imported here, so the base class is known only at run time
    base_retriever: Any = require("langchain_core.retrievers").BaseRetriever

    class MegalithRetriever(base_retriever):
        hybrid: Any
        top_k: int = 5
        search_mode: str = "hybrid"

        def _get_relevant_documents(self, query: str, *, run_manager: Any = None) -> list[Any]:
            hits = self.hybrid.retrieve(query, k=self.top_k, mode=self.search_mode).hits
            return [to_langchain_document(h) for h in hits]

    return MegalithRetriever(hybrid=retriever, top_k=k, search_mode=mode)
