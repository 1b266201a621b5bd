"""The built-in knowledge base: Python's own documentation topics and this project's READMEs."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from megalith_qa.documents import SourceDocument, content_hash

PYDOC_PREFIX = "pydoc:"


def pydoc_documents() -> Iterator[SourceDocument]:
    """One document per `pydoc_data.topics` entry, named `pydoc:<topic>`."""
    from pydoc_data.topics import topics

    for topic in sorted(topics):
        text = topics[topic]
        yield SourceDocument(
            source=f"{PYDOC_PREFIX}{topic}", text=text, source_hash=content_hash(text), kind="txt"
        )


def project_root(start: Path | None = None) -> Path | None:
    """The workspace root: the nearest ancestor holding both `packages/` and `README.md`."""
    here = (start or Path(__file__)).resolve()
    for parent in here.parents:
        if (parent / "packages").is_dir() and (parent / "README.md").is_file():
            return parent
    return None


def readme_documents(root: Path | None = None) -> Iterator[SourceDocument]:
    """The workspace README and every `packages/*/README.md`, named `readme:<relative path>`."""
    root = root or project_root()
    if root is None:
        return
    for path in [root / "README.md", *sorted(root.glob("packages/*/README.md"))]:
        if path.is_file() and path.read_bytes().strip():
            data = path.read_bytes()
            rel = path.relative_to(root).as_posix()
            text = data.decode("utf-8", errors="replace")
            yield SourceDocument(source=f"readme:{rel}", text=text, source_hash=content_hash(data), kind="md")


def builtin_documents() -> list[SourceDocument]:
    return [*pydoc_documents(), *readme_documents()]
