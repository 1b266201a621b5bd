from __future__ import annotations

import pytest

from megalith.common.errors import ConfigError
from megalith_qa.config import FusionWeights, RetrievalConfig
from megalith_qa.documents import ScoredChunk
from megalith_qa.ingest import load_bytes
from megalith_qa.knowledge import KnowledgeBase
from megalith_qa.retrieval import HybridRetriever, reciprocal_rank_fusion, rewrite_query


def _hits(*ids: str) -> list[ScoredChunk]:
    return [ScoredChunk(id=i, text=i, source=f"src-{i}", score=0.0) for i in ids]


def test_rrf_matches_hand_computed_scores() -> None:
    fused = reciprocal_rank_fusion(
        {"dense": _hits("a", "b", "c"), "bm25": _hits("c", "a")}, {"dense": 1.0, "bm25": 0.5}, k=10
    )
    # a: 1/11 + 0.5/12 ; b: 1/12 ; c: 1/13 + 0.5/11
    expected = {"a": 1 / 11 + 0.5 / 12, "b": 1 / 12, "c": 1 / 13 + 0.5 / 11}
    assert [h.id for h in fused] == sorted(expected, key=lambda x: -expected[x])
    for h in fused:
        assert h.score == pytest.approx(expected[h.id])
    assert fused[0].ranks == {"dense": 1, "bm25": 2}


def test_rrf_zero_weight_ignores_a_retriever() -> None:
    fused = reciprocal_rank_fusion(
        {"dense": _hits("a", "b"), "bm25": _hits("b", "a")}, {"dense": 0.0, "bm25": 1.0}, k=60
    )
    assert [h.id for h in fused] == ["b", "a"]


def test_fusion_weights_validate() -> None:
    with pytest.raises(ConfigError, match="FusionWeights"):
        FusionWeights(0.0, 0.0)
    with pytest.raises(ConfigError, match="top_k=9"):
        RetrievalConfig(top_k=9, candidates=5)


def test_rewrite_follow_up_adds_previous_terms() -> None:
    assert rewrite_query("What about its default?", ["How does the with statement work?"]) == (
        "What about its default? statement work"
    )
    standalone = "Explain integer literal underscores"
    assert rewrite_query(standalone, ["How does the with statement work?"]) == standalone
    assert rewrite_query("And it?", []) == "And it?"
    assert rewrite_query("它呢？", ["什么是检索增强？"]) == "它呢？ 什么是检索增强？"


def _corpus(kb: KnowledgeBase) -> None:
    docs = {
        "bees.txt": "Honey bees dance to tell other bees where flowers grow.",
        "ants.txt": "Leafcutter ants farm fungus in underground gardens.",
        "zh.txt": "检索增强生成把检索到的文档交给语言模型。向量数据库保存文本的嵌入。",
        "zh2.txt": "熊猫主要吃竹子，每天要吃很多。",
    }
    for name, text in docs.items():
        kb.ingest(load_bytes(name, text.encode()))


def test_hybrid_modes_and_chinese_bm25(embedded_kb: KnowledgeBase) -> None:
    _corpus(embedded_kb)
    ret = HybridRetriever(embedded_kb, RetrievalConfig(top_k=2, candidates=4))
    for mode in ("dense", "bm25", "hybrid"):
        assert ret.retrieve("where do bees find flowers", mode=mode).hits[0].source == "bees.txt"
    assert ret.retrieve("检索增强", mode="bm25").hits[0].source == "zh.txt"
    assert ret.retrieve("熊猫吃什么", mode="hybrid").hits[0].source == "zh2.txt"
    with pytest.raises(ConfigError, match="'sparse'"):
        ret.retrieve("x", mode="sparse")


def test_cache_never_serves_stale_results(embedded_kb: KnowledgeBase) -> None:
    _corpus(embedded_kb)
    ret = HybridRetriever(embedded_kb, RetrievalConfig(top_k=3, candidates=5))
    first = ret.retrieve("fungus gardens")
    assert not first.cached and first.hits[0].source == "ants.txt"
    assert ret.retrieve("fungus gardens").cached
    embedded_kb.delete("ants.txt")
    after = ret.retrieve("fungus gardens")
    assert not after.cached and after.version > first.version
    assert "ants.txt" not in {h.source for h in after.hits}


def test_langchain_retriever_adapter(embedded_kb: KnowledgeBase) -> None:
    pytest.importorskip("langchain_core")
    from megalith_qa.langchain_adapter import as_langchain_retriever

    _corpus(embedded_kb)
    lc = as_langchain_retriever(HybridRetriever(embedded_kb), k=2)
    docs = lc.invoke("leafcutter ants fungus")
    assert len(docs) == 2
    assert docs[0].metadata["source"] == "ants.txt" and docs[0].page_content.startswith("Leafcutter")
    assert docs[0].metadata["chunk_id"] == docs[0].id
