"""Loaders: raw bytes of a file -> plain text, one function per supported type.

Supported: txt, md, html/htm, pdf, csv, json, jsonl. Errors name the file (and line for line-based data).
"""

from __future__ import annotations

import csv
import io
import json
import re
from collections.abc import Callable
from html.parser import HTMLParser
from pathlib import PurePath
from typing import Any

from megalith.common.errors import DataError
from megalith_qa.documents import SourceDocument, content_hash


class UnsupportedTypeError(DataError):
    """The file extension has no loader (the server answers 415)."""


class UnsafeNameError(DataError):
    """A file name that tries to leave its directory or is empty (the server answers 400)."""


def _decode(name: str, data: bytes) -> str:
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise DataError(f"{name}: not UTF-8 text (byte {exc.start}: {exc.reason})") from exc


def load_text(name: str, data: bytes) -> str:
    return _decode(name, data)


def load_markdown(name: str, data: bytes) -> str:
    """Markdown keeps its text; heading marks and emphasis stars are dropped."""
    text = _decode(name, data)
    text = re.sub(r"^#{1,6}\s*", "", text, flags=re.MULTILINE)
    return re.sub(r"(\*\*|__|`{3}\w*)", "", text)


class _TextExtractor(HTMLParser):
    _SKIP = frozenset({"script", "style", "head", "noscript"})
    _BLOCK = frozenset({"p", "div", "br", "li", "h1", "h2", "h3", "h4", "h5", "h6", "tr", "section"})

    def __init__(self) -> None:
        super().__init__()
        self.parts: list[str] = []
        self._skip = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in self._SKIP:
            self._skip += 1
        elif tag in self._BLOCK:
            self.parts.append("\n")

    def handle_endtag(self, tag: str) -> None:
        if tag in self._SKIP and self._skip:
            self._skip -= 1
        elif tag in self._BLOCK:
            self.parts.append("\n")

    def handle_data(self, data: str) -> None:
        if not self._skip:
            self.parts.append(data)


def load_html(name: str, data: bytes) -> str:
    """Visible text of an HTML page (script/style/head dropped), block elements become line breaks."""
    parser = _TextExtractor()
    parser.feed(_decode(name, data))
    parser.close()
    text = "".join(parser.parts)
    return re.sub(r"\n\s*\n+", "\n\n", re.sub(r"[ \t]+", " ", text)).strip()


def load_pdf(name: str, data: bytes) -> str:
    """Text of every page, pages separated by blank lines."""
    from pypdf import PdfReader
    from pypdf.errors import PdfReadError

    try:
        reader = PdfReader(io.BytesIO(data))
        return "\n\n".join((page.extract_text() or "") for page in reader.pages)
    except (PdfReadError, ValueError, KeyError) as exc:
        raise DataError(f"{name}: not a readable PDF ({exc})") from exc


def load_csv(name: str, data: bytes) -> str:
    """One line per row: 'column: value; column: value' (the first row is the header)."""
    rows = list(csv.reader(io.StringIO(_decode(name, data))))
    if not rows:
        return ""
    header, lines = rows[0], []
    for lineno, row in enumerate(rows[1:], start=2):
        if len(row) != len(header):
            raise DataError(f"{name}:{lineno}: expected {len(header)} fields, got {len(row)}")
        lines.append("; ".join(f"{h}: {v}" for h, v in zip(header, row)))
    return "\n".join(lines)


def _flatten(value: Any, prefix: str = "") -> list[str]:
    """JSON value -> 'path: scalar' lines; string values at the top level stay as they are."""
    if isinstance(value, dict):
        return [line for k, v in value.items() for line in _flatten(v, f"{prefix}{k}.")]
    if isinstance(value, list):
        return [line for i, v in enumerate(value) for line in _flatten(v, f"{prefix}{i}.")]
    return [f"{prefix.rstrip('.')}: {value}" if prefix else str(value)]


def load_json(name: str, data: bytes) -> str:
    try:
        value = json.loads(_decode(name, data))
    except json.JSONDecodeError as exc:
        raise DataError(f"{name}:{exc.lineno}:{exc.colno}: invalid JSON ({exc.msg})") from exc
    return "\n".join(_flatten(value))


def load_jsonl(name: str, data: bytes) -> str:
    """One JSON value per non-empty line; records are separated by blank lines."""
    records = []
    for lineno, line in enumerate(_decode(name, data).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            records.append("\n".join(_flatten(json.loads(line))))
        except json.JSONDecodeError as exc:
            raise DataError(f"{name}:{lineno}: invalid JSON line ({exc.msg})") from exc
    return "\n\n".join(records)


LOADERS: dict[str, Callable[[str, bytes], str]] = {
    "txt": load_text,
    "md": load_markdown,
    "markdown": load_markdown,
    "html": load_html,
    "htm": load_html,
    "pdf": load_pdf,
    "csv": load_csv,
    "json": load_json,
    "jsonl": load_jsonl,
}
SUPPORTED_TYPES: tuple[str, ...] = tuple(sorted(LOADERS))


def file_kind(name: str) -> str:
    """Lower-case extension of `name` if a loader exists for it, else UnsupportedTypeError."""
    ext = PurePath(name).suffix.lower().lstrip(".")
    if ext not in LOADERS:
        raise UnsupportedTypeError(
            f"{name}: unsupported file type {ext or '(none)'!r}; supported: {SUPPORTED_TYPES}"
        )
    return ext


def load_bytes(name: str, data: bytes) -> SourceDocument:
    """Load raw bytes of a file called `name` into a SourceDocument (hash of the raw bytes)."""
    kind = file_kind(name)
    return SourceDocument(
        source=name, text=LOADERS[kind](name, data), source_hash=content_hash(data), kind=kind
    )


_UNSAFE = re.compile(r"[^A-Za-z0-9._\-\u4e00-\u9fff]+")


def sanitize_filename(name: str) -> str:
    """A bare file name safe to use as a source name: no directories, no '..', no control characters.

    Refuses (DataError) names that try to climb out of a directory, e.g. '../../etc/passwd' or
    'a/../../b', and names that sanitise to nothing; 'dir/notes.md' becomes 'notes.md'.
    """
    if "\x00" in name:
        raise UnsafeNameError(f"file name {name!r}: contains a NUL byte")
    parts = re.split(r"[\\/]+", name)
    if any(p == ".." for p in parts):
        raise UnsafeNameError(f"file name {name!r}: path traversal is not allowed")
    base = _UNSAFE.sub("_", parts[-1]).strip("._")
    if not base or "." not in base:
        raise UnsafeNameError(f"file name {name!r}: needs a name and an extension")
    return base[:200]
