"""Atomic output: build a directory under a temporary name, fsync it, then rename it into place.

A reader therefore sees either the complete previous output or the complete new one, never a
half-written directory, even if the writer is killed midway.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from megalith.checkpoint.atomic import fsync_dir, fsync_tree
from megalith.common.errors import ConfigError


class OutputExistsError(ConfigError, FileExistsError):
    """The output directory already exists and replacing it was not asked for.

    A `ConfigError` (so the CLI prints `error: ...` and exits 2) that is also a `FileExistsError`
    (what `atomic_directory` raised before, so existing callers keep working)."""


def check_output_free(target: str | os.PathLike[str], overwrite: bool = False) -> None:
    """Raise `OutputExistsError` if `target` exists and `overwrite` is off (call it before the work)."""
    path = Path(target).expanduser().resolve()
    if path.exists() and not overwrite:
        raise OutputExistsError(f"output {path} already exists (pass --overwrite to replace it)")


def _apply_umask(root: Path) -> None:
    """Give the tree ordinary permissions (mkdtemp/mkstemp create owner-only entries)."""
    umask = os.umask(0)
    os.umask(umask)
    root.chmod(0o777 & ~umask)
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames:
            os.chmod(os.path.join(dirpath, name), 0o777 & ~umask)
        for name in filenames:
            os.chmod(os.path.join(dirpath, name), 0o666 & ~umask)


@contextlib.contextmanager
def atomic_directory(target: str | os.PathLike[str], overwrite: bool = False) -> Iterator[Path]:
    """Yield a fresh temporary directory next to `target`; on success it is fsynced and renamed to `target`.

    On an exception the temporary directory is removed and `target` is left untouched.
    With `overwrite`, an existing `target` is replaced (moved aside, then deleted after the rename).
    """
    check_output_free(target, overwrite)
    target = Path(target).expanduser().resolve()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        yield tmp
        _apply_umask(tmp)
        move_into_place(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def move_into_place(src: Path, target: Path) -> None:
    """fsync the complete directory `src` and rename it to `target` (an existing `target` is moved
    aside first and deleted after the rename), so `target` is always either old or new, never partial."""
    fsync_tree(src)
    old = None
    if target.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
        os.replace(target, old / "content")
    os.replace(src, target)
    fsync_dir(target.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def write_json(path: Path, obj: Any) -> None:
    """Write `obj` as indented, key-sorted JSON (deterministic bytes for the same content)."""
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")
