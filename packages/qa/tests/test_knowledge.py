"""Ingestion, dedup, replacement, deletion and persistence; every test runs against the embedded
Chroma database and against a `chroma run` server (the `kb` / `client_factory` fixtures)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from megalith.common.errors import DataError
from megalith_qa.documents import doc_id_for
from megalith_qa.ingest import UnsupportedTypeError, load_bytes
from megalith_qa.knowledge import KnowledgeBase

PHRASES = {
    "notes.txt": "zebra migration",
    "guide.md": "kettle boils water",
    "page.html": "magma crater",
    "table.csv": "saturn moons",
    "record.json": "hubble telescope",
    "lines.jsonl": "albatross wingspan",
    "report.pdf": "glacier retreated",
}


def _sources(hits: list) -> set[str]:
    return {h.source for h in hits}


def test_every_type_is_ingested_and_found_by_both_retrievers(
    kb: KnowledgeBase, sample_files: dict[str, bytes]
) -> None:
    for name, data in sample_files.items():
        result = kb.ingest(load_bytes(name, data))
        assert result.status == "added" and result.chunks >= 1
    assert {r.source for r in kb.sources()} == set(sample_files)
    for name, phrase in PHRASES.items():
        assert kb.bm25_search(phrase, 1)[0].source == name
        assert name in _sources(kb.dense_search(phrase, 2))


def test_reingest_unchanged_is_a_noop(kb: KnowledgeBase, sample_files: dict[str, bytes]) -> None:
    doc = load_bytes("notes.txt", sample_files["notes.txt"] * 6)
    first = kb.ingest(doc)
    count, version = kb.store.count(), kb.version
    again = kb.ingest(load_bytes("notes.txt", sample_files["notes.txt"] * 6))
    assert again.status == "unchanged" and again.chunks == first.chunks
    assert kb.store.count() == count
    assert kb.version == version  # nothing was re-embedded or rewritten


def test_changed_file_replaces_old_chunks(kb: KnowledgeBase) -> None:
    kb.ingest(load_bytes("a.txt", b"Penguins huddle together on the antarctic ice shelf. " * 8))
    old_ids = set(kb.store.records_for(doc_id_for("a.txt"))[0])
    res = kb.ingest(load_bytes("a.txt", b"Cacti store water in their thick stems."))
    assert res.status == "replaced" and res.chunks == 1
    ids, hashes = kb.store.records_for(doc_id_for("a.txt"))
    assert len(ids) == 1 and len(hashes) == 1
    assert kb.bm25_search("penguins antarctic", 5) == []
    assert kb.bm25_search("cacti", 5)[0].source == "a.txt"
    assert not old_ids - {ids[0]} & {h.id for h in kb.dense_search("penguins huddle on ice", 10)}


def test_identical_chunks_inside_a_source_are_stored_once(kb: KnowledgeBase) -> None:
    para = "Quokkas live on Rottnest Island and smile for photographs."  # 58 chars < chunk size 120
    text = "\n\n".join([para] * 5 + ["Koalas sleep most of the day in eucalyptus trees."])
    res = kb.ingest(load_bytes("dup.md", text.encode()))
    texts = [t for t, _ in kb.store.get(kb.store.records_for(doc_id_for("dup.md"))[0]).values()]
    assert res.chunks == len(texts) == len(set(texts))
    assert sum(para in t for t in texts) < 5


def test_delete_removes_from_dense_and_bm25(kb: KnowledgeBase, sample_files: dict[str, bytes]) -> None:
    for name in ("notes.txt", "guide.md"):
        kb.ingest(load_bytes(name, sample_files[name]))
    assert kb.bm25_search("zebra", 3)
    removed = kb.delete(doc_id_for("notes.txt"))
    assert removed == 1
    assert kb.bm25_search("zebra migration river", 5) == []
    assert "notes.txt" not in _sources(kb.dense_search("zebra migration river", 5))
    assert kb.delete("guide.md") == 1  # by source name
    assert kb.store.count() == 0
    assert kb.delete("missing.txt") == 0


def test_index_persists_across_restart(
    client_factory: Callable[[], object],
    collection_name: str,
    kb_factory: Callable[[object, str], KnowledgeBase],
    sample_files: dict[str, bytes],
) -> None:
    first = kb_factory(client_factory(), collection_name)
    first.ingest(load_bytes("guide.md", sample_files["guide.md"]))
    count = first.store.count()
    del first
    second = kb_factory(client_factory(), collection_name)
    assert second.store.count() == count
    assert second.ingest(load_bytes("guide.md", sample_files["guide.md"])).status == "unchanged"
    assert second.bm25_search("kettle", 1)[0].source == "guide.md"


def test_ingest_paths_walks_folders_and_refuses_bad_paths(kb: KnowledgeBase, tmp_path: Path) -> None:
    (tmp_path / "docs" / "sub").mkdir(parents=True)
    (tmp_path / "docs" / "one.txt").write_text("Otters hold hands while sleeping.")
    (tmp_path / "docs" / "sub" / "two.md").write_text("Narwhal tusks are teeth.")
    (tmp_path / "docs" / "skip.bin").write_bytes(b"\x00\x01")
    results = kb.ingest_paths([tmp_path / "docs"])
    assert sorted(r.source for r in results) == ["one.txt", "two.md"]
    with pytest.raises(DataError, match="nope"):
        kb.ingest_paths([tmp_path / "nope"])
    with pytest.raises(UnsupportedTypeError):
        kb.ingest_paths([tmp_path / "docs" / "skip.bin"])


def test_empty_document_is_refused(kb: KnowledgeBase) -> None:
    with pytest.raises(DataError, match="empty.txt"):
        kb.ingest(load_bytes("empty.txt", b"   \n"))
