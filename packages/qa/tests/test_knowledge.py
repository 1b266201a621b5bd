"""Ingestion, dedup, replacement, deletion and persistence; every test runs against the embedded
Chroma database and against a `chroma run` server (the `kb` / `client_factory` fixtures)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from megalith.common.errors import DataError
from megalith_qa.documents import doc_id_for
from megalith_qa.ingest import UnsupportedTypeError, load_bytes
from megalith_qa.knowledge import KnowledgeBase, make_chunks
from megalith_qa.retrieval import HybridRetriever

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
    assert sorted(r.source for r in results) == ["one.txt", "sub/two.md"]  # relative to the named folder
    with pytest.raises(DataError, match="nope"):
        kb.ingest_paths([tmp_path / "nope"])
    with pytest.raises(UnsupportedTypeError):
        kb.ingest_paths([tmp_path / "docs" / "skip.bin"])


def test_ingest_paths_stores_nothing_when_a_file_is_bad(kb: KnowledgeBase, tmp_path: Path) -> None:
    """All files are read and parsed before anything is stored: a bad one (here malformed JSON
    after a good text file) raises BadFileError naming its path and line; skip_bad leaves it out."""
    from megalith_qa.knowledge import BadFileError

    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("Otters hold hands while sleeping.")
    (tmp_path / "docs" / "b.jsonl").write_text('{"text": "fine"}\n{"text": \n')
    before = kb.store.count()
    with pytest.raises(BadFileError, match=rf"^{tmp_path / 'docs' / 'b.jsonl'}:2"):
        kb.ingest_paths([tmp_path / "docs"])
    assert kb.store.count() == before
    results = kb.ingest_paths([tmp_path / "docs"], skip_bad=True)
    assert [(r.source, r.status) for r in results] == [("a.txt", "added"), ("b.jsonl", "skipped")]
    assert results[1].error.startswith(f"{tmp_path / 'docs' / 'b.jsonl'}:2") and results[1].chunks == 0
    assert kb.bm25_search("otters", 1)[0].source == "a.txt"


def test_empty_document_is_refused(kb: KnowledgeBase) -> None:
    with pytest.raises(DataError, match="empty.txt"):
        kb.ingest(load_bytes("empty.txt", b"   \n"))


def test_same_file_name_in_different_folders_stays_distinct(kb: KnowledgeBase, tmp_path: Path) -> None:
    for sub, text in (
        ("a", "Zebra stripes confuse biting flies."),
        ("b", "Walrus tusks help them climb ice."),
    ):
        (tmp_path / "tree" / sub).mkdir(parents=True)
        (tmp_path / "tree" / sub / "README.md").write_text(text)
    results = kb.ingest_paths([tmp_path / "tree"])
    assert sorted((r.source, r.status) for r in results) == [
        ("a/README.md", "added"),
        ("b/README.md", "added"),
    ]
    assert kb.bm25_search("zebra", 1)[0].source == "a/README.md"
    assert kb.bm25_search("walrus", 1)[0].source == "b/README.md"
    # two files named directly that would share a source name are refused before anything is stored
    a, b = tmp_path / "tree" / "a" / "README.md", tmp_path / "tree" / "b" / "README.md"
    with pytest.raises(DataError, match=r"'README\.md'") as err:
        kb.ingest_paths([a, b])
    assert str(a) in str(err.value) and str(b) in str(err.value)


V1 = b"Version one of the notes. Zebras cross rivers in spring."
V2 = (
    b"Version two of the notes, rewritten from scratch. Lions wait at the water hole until dusk falls. "
    b"Giraffes eat acacia leaves from the tallest trees. Elephants dig for water in dry river beds. "
    b"Hippos spend the hot afternoons submerged in muddy pools near the bank."
)


def _fail_on_call(obj: Any, method: str, monkeypatch: pytest.MonkeyPatch, call: int) -> None:
    """Make `obj.method` raise on its `call`-th call (1-based), as a dropped server or a Ctrl+C would."""
    real, calls = getattr(obj, method), [0]

    def flaky(**kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == call:
            raise RuntimeError(f"simulated failure in {method}")
        return real(**kwargs)

    monkeypatch.setattr(obj, method, flaky)


def test_failed_replace_keeps_the_old_version(
    embedded_kb: KnowledgeBase, monkeypatch: pytest.MonkeyPatch
) -> None:
    kb = embedded_kb
    kb.ingest(load_bytes("notes.txt", V1))
    before = kb.sources()
    n_v2 = len(make_chunks(load_bytes("notes.txt", V2), kb.splitter))
    assert n_v2 > 2
    monkeypatch.setattr(kb.store, "_batch", 2)
    _fail_on_call(kb.store.collection, "upsert", monkeypatch, call=2)  # the 2nd batch of v2 fails
    with pytest.raises(RuntimeError, match="simulated"):
        kb.ingest(load_bytes("notes.txt", V2))
    monkeypatch.undo()
    assert kb.sources() == before  # v1 intact: same hash, same chunk count, nothing of v2 left
    assert kb.bm25_search("zebras", 3)[0].source == "notes.txt"
    retry = kb.ingest(load_bytes("notes.txt", V2))
    assert retry.status == "replaced" and retry.chunks == n_v2
    assert kb.bm25_search("zebras", 3) == [] and kb.bm25_search("giraffes", 1)[0].source == "notes.txt"


def test_incomplete_stored_version_is_not_reported_unchanged(
    embedded_kb: KnowledgeBase, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Even when the clean-up after a failed write fails too, re-ingesting the same bytes completes it."""
    kb = embedded_kb
    doc = load_bytes("notes.txt", V2)
    monkeypatch.setattr(kb.store, "_batch", 2)
    _fail_on_call(kb.store.collection, "upsert", monkeypatch, call=2)
    _fail_on_call(kb.store.collection, "delete", monkeypatch, call=1)
    with pytest.raises(RuntimeError, match="upsert"):
        kb.ingest(doc)
    monkeypatch.undo()
    stored = kb.store.stored(doc_id_for("notes.txt"))
    assert len(stored.ids) == 2 and stored.hashes == {doc.source_hash} and not stored.complete
    retry = kb.ingest(doc)
    assert retry.status != "unchanged" and retry.chunks == len(make_chunks(doc, kb.splitter))
    assert kb.store.stored(doc_id_for("notes.txt")).complete
    assert kb.ingest(doc).status == "unchanged"


def test_empty_new_version_keeps_the_stored_document(kb: KnowledgeBase) -> None:
    kb.ingest(load_bytes("notes.txt", V1))
    before = kb.sources()
    with pytest.raises(DataError, match=r"notes\.txt: no text to index"):
        kb.ingest(load_bytes("notes.txt", b"   \n\t "))
    assert kb.sources() == before


def test_writes_by_another_process_are_seen(
    client_factory: Callable[[], object],
    collection_name: str,
    kb_factory: Callable[[object, str], KnowledgeBase],
) -> None:
    """A server's cache and BM25 index notice writes made through another client (`qa-serve ingest`, or a
    second server on the same Chroma): the version follows the store's generation marker and chunk count."""
    server = kb_factory(client_factory(), collection_name)
    server.ingest(load_bytes("tea.txt", b"Green tea is steeped at 80 degrees."))
    retriever = HybridRetriever(server)
    assert "zebra.txt" not in {h.source for h in retriever.retrieve("zebra migration").hits}
    assert server.bm25_search("zebra migration", 5) == []
    version = server.version
    other = kb_factory(client_factory(), collection_name)
    other.ingest(load_bytes("zebra.txt", b"The zebra migration crosses the river every spring."))
    after = retriever.retrieve("zebra migration")
    assert not after.cached and after.version > version
    assert after.hits[0].source == "zebra.txt"
    assert server.bm25_search("zebra migration", 5)[0].source == "zebra.txt"
    other.delete("zebra.txt")
    assert "zebra.txt" not in {h.source for h in retriever.retrieve("zebra migration").hits}
    # a writer that does not publish a generation marker is still noticed through the chunk count
    other.store.collection.add(
        ids=["raw:0"],
        documents=["Walrus colonies haul out on sea ice."],
        metadatas=[{"source": "raw.txt", "doc_id": "raw", "source_hash": "h", "position": 0}],
        embeddings=other.embedder.embed(["Walrus colonies haul out on sea ice."]),
    )
    assert server.bm25_search("walrus", 1)[0].source == "raw.txt"
