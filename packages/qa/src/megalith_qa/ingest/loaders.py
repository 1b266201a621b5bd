"""Loaders: raw bytes of a file -> plain text, one function per supported type.

Supported: txt, md, html/htm, pdf, csv, json, jsonl. Malformed data raises DataError naming the file, and
the line (and column where known) for text formats: syntax errors, JSON nested deeper than MAX_JSON_DEPTH,
integers longer than Python converts (`sys.get_int_max_str_digits()`), CSV fields over the csv module's
field limit, PDFs pypdf cannot read.
"""

from __future__ import annotations

import csv
import io
import json
import re
import sys
import unicodedata
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
    from pypdf.errors import PyPdfError

    try:
        reader = PdfReader(io.BytesIO(data))
        return "\n\n".join((page.extract_text() or "") for page in reader.pages)
    except (PyPdfError, ValueError, KeyError, RecursionError) as exc:  # PyPdfError: LimitReachedError, ...
        raise DataError(f"{name}: not a readable PDF ({type(exc).__name__}: {exc})") from exc


def load_csv(name: str, data: bytes) -> str:
    """One line per row: 'column: value; column: value' (the first row is the header; blank lines skipped).

    Errors name the physical line where the offending row starts (a quoted field may span several lines).
    """
    reader = csv.reader(io.StringIO(_decode(name, data)))
    header: list[str] | None = None
    lines: list[str] = []
    start = 1  # first physical line of the row being read
    try:
        for row in reader:
            if header is None and row:
                header = row
            elif row and len(row) != len(header or ()):
                raise DataError(f"{name}:{start}: expected {len(header or ())} fields, got {len(row)}")
            elif row:
                lines.append("; ".join(f"{h}: {v}" for h, v in zip(header or (), row)))
            start = reader.line_num + 1
    except csv.Error as exc:  # e.g. "field larger than field limit (131072)", "line contains NUL"
        raise DataError(f"{name}:{start}: {exc}") from exc
    return "\n".join(lines)


MAX_JSON_DEPTH = 200  # nesting levels of arrays/objects accepted in JSON and JSON-lines files


class _JsonLimitError(ValueError):
    """Valid JSON that goes past a limit; `pos` is the character offset of the offending value."""

    def __init__(self, pos: int, reason: str) -> None:
        super().__init__(reason)
        self.pos = pos


class _TooDeep(Exception):
    pass


def _flatten(value: Any) -> list[str]:
    """JSON value -> 'path: scalar' lines in document order; a top-level scalar stays as it is.

    Iterative (explicit stack): nesting costs no Python recursion. Deeper than MAX_JSON_DEPTH -> _TooDeep.
    """
    lines: list[str] = []
    stack: list[tuple[str, Any, int]] = [("", value, 0)]
    while stack:
        prefix, item, depth = stack.pop()
        if isinstance(item, dict | list):
            if depth >= MAX_JSON_DEPTH:
                raise _TooDeep
            pairs = list(item.items() if isinstance(item, dict) else enumerate(item))
            stack.extend((f"{prefix}{k}.", v, depth + 1) for k, v in reversed(pairs))
        else:
            lines.append(f"{prefix.rstrip('.')}: {item}" if prefix else str(item))
    return lines


# strings (skipped whole), brackets, numbers: enough to find where a limit is passed
_JSON_SCAN = re.compile(r'"(?>[^"\\]+|\\.)*"|[\[{\]}]|-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?')


def _locate_limit(text: str, exc: BaseException) -> _JsonLimitError:
    """Offset and reason of the first value nested deeper than MAX_JSON_DEPTH or integer longer than
    Python converts (only run after parsing or flattening failed, so its cost is paid on bad input only)."""
    max_digits, depth = sys.get_int_max_str_digits(), 0
    for m in _JSON_SCAN.finditer(text):
        tok = m.group()
        if tok in ("[", "{"):
            depth += 1
            if depth > MAX_JSON_DEPTH:
                return _JsonLimitError(m.start(), f"nested deeper than {MAX_JSON_DEPTH} levels")
        elif tok in ("]", "}"):
            depth -= 1
        elif max_digits and tok.lstrip("-").isdigit() and len(tok.lstrip("-")) > max_digits:
            digits = len(tok.lstrip("-"))
            return _JsonLimitError(m.start(), f"integer with {digits} digits (the limit is {max_digits})")
    return _JsonLimitError(0, f"{type(exc).__name__}: {exc}")


def _parse_json(text: str) -> list[str]:
    """Flattened lines of one JSON text; JSONDecodeError on bad syntax, _JsonLimitError past a limit."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        raise
    except (RecursionError, ValueError) as exc:  # too deep for the parser; int longer than the digit limit
        raise _locate_limit(text, exc) from exc
    try:
        return _flatten(value)
    except _TooDeep as exc:
        raise _locate_limit(text, exc) from exc


def _line_col(text: str, pos: int) -> tuple[int, int]:
    return text.count("\n", 0, pos) + 1, pos - text.rfind("\n", 0, pos)


def load_json(name: str, data: bytes) -> str:
    text = _decode(name, data)
    try:
        return "\n".join(_parse_json(text))
    except json.JSONDecodeError as exc:
        raise DataError(f"{name}:{exc.lineno}:{exc.colno}: invalid JSON ({exc.msg})") from exc
    except _JsonLimitError as exc:
        line, col = _line_col(text, exc.pos)
        raise DataError(f"{name}:{line}:{col}: {exc}") from exc


def load_jsonl(name: str, data: bytes) -> str:
    """One JSON value per non-empty line; records are separated by blank lines.

    Lines end at "\\n" only: U+2028, U+0085, \\x0b and \\x0c are legal inside JSON strings.
    """
    records = []
    for lineno, line in enumerate(_decode(name, data).split("\n"), start=1):
        if not line.strip():
            continue
        try:
            records.append("\n".join(_parse_json(line)))
        except json.JSONDecodeError as exc:
            raise DataError(f"{name}:{lineno}: invalid JSON line ({exc.msg})") from exc
        except _JsonLimitError as exc:
            raise DataError(f"{name}:{lineno}:{exc.pos + 1}: {exc}") from exc
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


_UNSAFE = re.compile(r"[^\w.\-]+")  # \w is Unicode-aware: letters and digits of every script, and "_"
MAX_NAME_CHARS = 200


def sanitize_filename(name: str) -> str:
    """A bare file name safe to use as a source name: no directories, no '..', no control characters.

    Refuses (UnsafeNameError) names that try to climb out of a directory, e.g. '../../etc/passwd' or
    'a/../../b', and names that sanitise to nothing; 'dir/notes.md' becomes 'notes.md'. The name is
    NFC-normalised; letters and digits of any script, '.', '-' and '_' are kept, other runs become '_'.
    When that changed the name, or it is longer than MAX_NAME_CHARS, the stem is shortened as needed and
    '-' plus 8 hex digits of the original name's SHA-256 is appended before the (kept) extension, so two
    different names never merge into one source: 'a b.txt' -> 'a_b-<hash>.txt'.
    """
    if "\x00" in name:
        raise UnsafeNameError(f"file name {name!r}: contains a NUL byte")
    parts = re.split(r"[\\/]+", name)
    if any(p == ".." for p in parts):
        raise UnsafeNameError(f"file name {name!r}: path traversal is not allowed")
    original = unicodedata.normalize("NFC", parts[-1])
    base = _UNSAFE.sub("_", original).strip("._")
    if not base or "." not in base:
        raise UnsafeNameError(f"file name {name!r}: needs a name and an extension")
    if base == original and len(base) <= MAX_NAME_CHARS:
        return base
    stem, _, ext = base.rpartition(".")
    tag = "-" + content_hash(original)[:8]
    room = max(1, MAX_NAME_CHARS - len(tag) - len(ext) - 1)
    return f"{stem[:room].rstrip('._')}{tag}.{ext}"
