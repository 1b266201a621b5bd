"""The built-in English corpus: Python's own documentation, available offline everywhere.

Documents, in this fixed order:
1. every topic of `pydoc_data.topics` (the language reference sections `help()` shows), by sorted key;
2. for each module of `CORPUS_MODULES` (a fixed, sorted list of pure standard-library modules):
   the module docstring followed by the docstrings of its public classes and functions defined in
   that module, in sorted name order.

The held-out split is deterministic and independent of the order: document `id` is held out iff
`int(sha256(id)[:8], 16) % 100 < heldout_percent`.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import inspect
import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from megalith.common.errors import ConfigError

Split = Literal["train", "heldout", "all"]
DEFAULT_HELDOUT_PERCENT = 10

# Sorted; pure-Python or always-built modules with substantial English docstrings, present on 3.11-3.13.
CORPUS_MODULES: tuple[str, ...] = (
    "abc", "argparse", "ast", "asyncio", "base64", "bdb", "bisect", "bz2", "calendar", "cmd", "code",
    "codecs", "codeop", "collections", "colorsys", "compileall", "concurrent.futures", "configparser",
    "contextlib", "contextvars", "copy", "copyreg", "csv", "dataclasses", "datetime", "decimal",
    "difflib", "dis", "doctest", "email", "enum", "filecmp", "fileinput", "fnmatch", "fractions",
    "ftplib", "functools", "getopt", "gettext", "glob", "graphlib", "gzip", "hashlib", "heapq", "hmac",
    "html", "html.parser", "http", "http.client", "http.cookies", "imaplib", "importlib", "inspect", "io",
    "ipaddress", "itertools", "json", "keyword", "linecache", "locale", "logging", "logging.handlers",
    "lzma", "mailbox", "math", "mimetypes", "modulefinder", "netrc", "numbers", "operator", "optparse",
    "os", "pathlib", "pdb", "pickle", "pickletools", "pkgutil", "platform", "plistlib", "poplib",
    "pprint", "profile", "pstats", "py_compile", "pyclbr", "queue", "quopri", "random", "re", "reprlib",
    "runpy", "sched", "secrets", "selectors", "shelve", "shlex", "shutil", "smtplib", "socket",
    "socketserver", "statistics", "string", "stringprep", "struct", "subprocess", "symtable",
    "sysconfig", "tabnanny", "tarfile", "tempfile", "textwrap", "threading", "timeit", "token",
    "tokenize", "tomllib", "trace", "traceback", "types", "typing", "unittest", "urllib.parse",
    "urllib.request", "uuid", "warnings", "wave", "weakref", "zipapp", "zipfile", "zoneinfo",
)  # fmt: skip


@dataclass(frozen=True)
class Document:
    """One corpus document: a stable id ("topic:<key>" or "module:<name>") and its text."""

    id: str
    text: str


def _topic_documents() -> list[Document]:
    from pydoc_data import topics

    return [Document(f"topic:{key}", topics.topics[key].strip()) for key in sorted(topics.topics)]


def _module_text(name: str) -> str:
    with warnings.catch_warnings():  # e.g. typing.io / typing.re warn when their docs are read
        warnings.simplefilter("ignore", DeprecationWarning)
        return _collect_docs(name)


def _collect_docs(name: str) -> str:
    module = importlib.import_module(name)
    parts = [inspect.getdoc(module) or ""]
    for attr in sorted(vars(module)):
        obj = vars(module)[attr]
        if attr.startswith("_") or getattr(obj, "__module__", None) != name:
            continue
        if not (inspect.isclass(obj) or inspect.isfunction(obj)):
            continue
        doc = inspect.getdoc(obj)
        if doc:
            parts.append(f"{attr}: {doc}")
    return "\n\n".join(p for p in parts if p).strip()


def _module_documents() -> list[Document]:
    docs = []
    for name in CORPUS_MODULES:
        try:
            text = _module_text(name)
        except ImportError:  # a platform without this module (e.g. a stripped-down Python build)
            continue
        if text:
            docs.append(Document(f"module:{name}", text))
    return docs


@functools.lru_cache(maxsize=1)
def _all_documents() -> tuple[Document, ...]:
    return tuple(_topic_documents() + _module_documents())


def is_heldout(doc_id: str, heldout_percent: int = DEFAULT_HELDOUT_PERCENT) -> bool:
    """Deterministic split membership from the document id alone."""
    return int(hashlib.sha256(doc_id.encode()).hexdigest()[:8], 16) % 100 < heldout_percent


def builtin_documents(split: Split = "all", heldout_percent: int = DEFAULT_HELDOUT_PERCENT) -> list[Document]:
    """The corpus documents of `split` ("train", "heldout" or "all"), in the fixed order above."""
    if split not in ("train", "heldout", "all"):
        raise ConfigError(f"split must be 'train', 'heldout' or 'all', got {split!r}")
    if not 0 <= heldout_percent <= 100:
        raise ConfigError(f"heldout_percent must be in [0, 100], got {heldout_percent}")
    docs = list(_all_documents())
    if split == "all":
        return docs
    want = split == "heldout"
    return [d for d in docs if is_heldout(d.id, heldout_percent) == want]


def write_jsonl(path: str | os.PathLike[str], split: Split = "train") -> Path:
    """Write the split as `{"text": ..., "id": ...}` lines (an input `prepare` understands)."""
    out = Path(path)
    with out.open("w", encoding="utf-8") as f:
        for doc in builtin_documents(split):
            f.write(json.dumps({"text": doc.text, "id": doc.id}, ensure_ascii=False) + "\n")
    return out
