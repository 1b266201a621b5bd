from __future__ import annotations

import numpy as np
import pytest

from megalith.common.errors import ConfigError
from megalith_qa.embedding import HashingEmbedder, MiniLMEmbedder, make_embedder
from megalith_qa.memory import ConversationMemory, approx_tokens


def test_approx_tokens_counts_words_cjk_and_punctuation() -> None:
    assert approx_tokens("Hello, world!") == 4
    assert approx_tokens("你好 world") == 3


def test_sessions_are_isolated() -> None:
    mem = ConversationMemory(token_budget=64)
    mem.add("alice", "user", "My secret is swordfish.")
    assert mem.turns("bob") == []
    assert "swordfish" not in mem.render("bob")
    assert "swordfish" in mem.render("alice")


def test_budget_folds_old_turns_into_summary() -> None:
    mem = ConversationMemory(token_budget=40)
    for i in range(6):
        mem.add("s", "user", f"Question number {i} is about topic {i}. Extra words here to use tokens.")
    turns = mem.turns("s")
    assert sum(approx_tokens(t.content) for t in turns) <= 40
    assert len(turns) < 6
    summary = mem.summary("s")
    assert "Question number" in summary and "Extra words" not in summary  # first sentence only
    assert approx_tokens(summary) <= 20 or summary.count("\n") == 0


def test_memory_rejects_tiny_budget() -> None:
    with pytest.raises(ConfigError, match="8"):
        ConversationMemory(token_budget=8)


def test_hashing_embedder_is_unit_norm_and_deterministic() -> None:
    emb = HashingEmbedder(64)
    vecs = emb.embed(["red apples", "red apples", "blue ocean waves"])
    assert vecs.shape == (3, 64) and vecs.dtype == np.float32
    assert np.allclose(np.linalg.norm(vecs, axis=1), 1.0, atol=1e-6)
    assert np.array_equal(vecs[0], vecs[1])
    assert float(vecs[0] @ vecs[2]) < 0.99


def test_make_embedder_rejects_unknown() -> None:
    with pytest.raises(ConfigError, match="'word2vec'"):
        make_embedder("word2vec")
    with pytest.raises(ConfigError, match="4"):
        HashingEmbedder(4)


def test_minilm_real_model_ranks_paraphrase_closest() -> None:
    emb = MiniLMEmbedder()
    vecs = emb.embed(
        ["How do I open a file in Python?", "Reading files with the open() function", "Giraffes eat leaves"]
    )
    assert vecs.shape == (3, 384)
    assert np.allclose(np.linalg.norm(vecs, axis=1), 1.0, atol=1e-5)
    assert float(vecs[0] @ vecs[1]) > float(vecs[0] @ vecs[2]) + 0.2
