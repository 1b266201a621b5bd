"""The built-in corpus: fixed order, deterministic held-out split."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from megalith.common.errors import ConfigError
from megalith_llama.corpus import CORPUS_MODULES, builtin_documents, write_jsonl


def test_corpus_order_and_split() -> None:
    from pydoc_data import topics

    docs = builtin_documents("all")
    ids = [d.id for d in docs]
    n_topics = len(topics.topics)
    assert ids[:n_topics] == [f"topic:{k}" for k in sorted(topics.topics)]
    modules = [i.removeprefix("module:") for i in ids[n_topics:]]
    assert modules == sorted(modules) and set(modules) <= set(CORPUS_MODULES)
    assert len(modules) > 0.9 * len(CORPUS_MODULES)
    assert list(CORPUS_MODULES) == sorted(CORPUS_MODULES)
    json_doc = next(d for d in docs if d.id == "module:json")
    assert "JSON" in json_doc.text and "dumps" in json_doc.text

    held = builtin_documents("heldout")
    train = builtin_documents("train")
    expected_held = [i for i in ids if int(hashlib.sha256(i.encode()).hexdigest()[:8], 16) % 100 < 10]
    assert [d.id for d in held] == expected_held
    assert [d.id for d in train] == [i for i in ids if i not in set(expected_held)]
    assert 0.05 * len(docs) < len(held) < 0.2 * len(docs)
    assert [d.text for d in builtin_documents("heldout")] == [d.text for d in held]  # deterministic


def test_write_jsonl_and_bad_split(tmp_path: Path) -> None:
    out = write_jsonl(tmp_path / "h.jsonl", "heldout")
    rows = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert [r["id"] for r in rows] == [d.id for d in builtin_documents("heldout")]
    assert all(r["text"] for r in rows)
    with pytest.raises(ConfigError, match="'valid'"):
        builtin_documents("valid")  # type: ignore[arg-type]
