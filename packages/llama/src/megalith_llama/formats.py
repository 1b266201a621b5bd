"""Input formats for `prepare`: jsonl (`{"text"}` or Colossal-LLaMA `{"source","target","category"}`),
plain text, and the built-in corpus.

Every input becomes a stream of `Record(prompt, text)`: prompt tokens are context only (label -100),
text tokens are trained on. `{"text": t}` is `Record("", t)`; `{"source": s, "target": t}` is
`Record(s, t)`. Plain-text files are split into documents by `text_unit`: "paragraph" (blocks
separated by blank lines, the default), "line", or "file" (the whole file is one document).
Blank jsonl lines and empty documents are skipped; anything else malformed is a `DataError` naming
`file:line`, or, with `skip_bad_lines`, counted in `ReadStats`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from megalith.common.errors import DataError

logger = logging.getLogger(__name__)

BUILTIN_PREFIX = "builtin:"
TEXT_UNITS = ("paragraph", "line", "file")
JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")


@dataclass(frozen=True)
class Record:
    """One document: `prompt` is masked out of the loss, `text` is learned (plus the end token)."""

    prompt: str
    text: str


@dataclass
class ReadStats:
    """What a reader skipped: malformed lines (with skip_bad_lines) and empty documents."""

    bad_lines: int = 0
    empty: int = 0
    examples: list[str] = field(default_factory=list)

    def bad(self, where: str, why: str, skip: bool) -> None:
        if not skip:
            raise DataError(f"{where}: {why}")
        self.bad_lines += 1
        if len(self.examples) < 5:
            self.examples.append(f"{where}: {why}")


def input_format(path: str) -> str:
    """ "builtin", "jsonl" or "text", from the input name."""
    if path.startswith(BUILTIN_PREFIX):
        return "builtin"
    return "jsonl" if Path(path).suffix.lower() in JSONL_SUFFIXES else "text"


def parse_json_record(line: str) -> Record:
    """Parse one jsonl line; raises ValueError with the reason when it is not a valid record."""
    obj = json.loads(line)
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    if "text" in obj:
        if not isinstance(obj["text"], str):
            raise ValueError(f"'text' must be a string, got {type(obj['text']).__name__}")
        return Record("", obj["text"])
    if "source" in obj and "target" in obj:
        source, target = obj["source"], obj["target"]
        if not isinstance(source, str) or not isinstance(target, str):
            raise ValueError("'source' and 'target' must be strings")
        return Record(source, target)
    raise ValueError(f"expected a 'text' field or 'source' and 'target' fields, got keys {sorted(obj)}")


def _iter_jsonl(path: Path, stats: ReadStats, skip: bool) -> Iterator[Record]:
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
                if not line.strip():
                    continue
                yield parse_json_record(line)
            except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
                stats.bad(where, str(exc), skip)


def _decoded_lines(path: Path, stats: ReadStats, skip: bool) -> Iterator[str]:
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                yield raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                stats.bad(f"{path}:{lineno}", f"not UTF-8: {exc}", skip)


def _iter_text(path: Path, unit: str, stats: ReadStats, skip: bool) -> Iterator[Record]:
    lines = _decoded_lines(path, stats, skip)
    if unit == "line":
        yield from (Record("", line.rstrip("\r\n")) for line in lines)
        return
    if unit == "file":
        yield Record("", "".join(lines))
        return
    block: list[str] = []
    for line in lines:
        if line.strip():
            block.append(line)
        elif block:
            yield Record("", "".join(block).rstrip("\r\n"))
            block = []
    if block:
        yield Record("", "".join(block).rstrip("\r\n"))


def _iter_builtin(name: str) -> Iterator[Record]:
    from megalith_llama.corpus import builtin_documents

    split = name[len(BUILTIN_PREFIX) :] or "train"
    for doc in builtin_documents(split):  # type: ignore[arg-type]
        yield Record("", doc.text)


def iter_records(
    path: str, *, text_unit: str = "paragraph", skip_bad_lines: bool = False, stats: ReadStats | None = None
) -> Iterator[Record]:
    """Records of one input (a file path or "builtin:train" / "builtin:heldout" / "builtin:all")."""
    if text_unit not in TEXT_UNITS:
        raise DataError(f"text_unit must be one of {TEXT_UNITS}, got {text_unit!r}")
    stats = stats if stats is not None else ReadStats()
    kind = input_format(path)
    if kind == "builtin":
        records = _iter_builtin(path)
    elif not Path(path).is_file():
        raise DataError(f"input file not found: {path}")
    elif kind == "jsonl":
        records = _iter_jsonl(Path(path), stats, skip_bad_lines)
    else:
        records = _iter_text(Path(path), text_unit, stats, skip_bad_lines)
    for record in records:
        if record.prompt or record.text:
            yield record
        else:
            stats.empty += 1
