"""Atomic checkpoint directories: write to a staging directory, fsync, rename into place.

An interrupted save leaves the previous checkpoint untouched. Replacing an existing directory
takes two renames (NAME → `.NAME.old`, staging → NAME); `resolve` finds the old one if a crash
fell between them. A directory is only ever deleted while another complete one exists: `.NAME.old`
goes only once NAME is in place, so every state a crash can leave ({NAME}, {NAME, .old},
{.old, staging}, {.old}) holds a loadable checkpoint, also after a second crash in the next commit.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from megalith.common.errors import CheckpointError


def staging_path(path: str | os.PathLike[str]) -> Path:
    p = Path(path)
    return p.parent / f".{p.name}.tmp"


def _old_path(path: Path) -> Path:
    return path.parent / f".{path.name}.old"


def fresh_staging(path: str | os.PathLike[str]) -> Path:
    """Create an empty staging directory for `path` (removing leftovers of an interrupted save)."""
    tmp = staging_path(path)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def fsync_tree(root: Path) -> None:
    """fsync every file below `root`, then every directory (so the entries are durable)."""
    for dirpath, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(dirpath))


def fsync_dir(path: Path) -> None:
    """fsync a directory (makes renames and new entries in it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit(path: str | os.PathLike[str]) -> Path:
    """fsync the staging directory of `path` and move it into place atomically."""
    final = Path(path)
    tmp = staging_path(final)
    if not tmp.is_dir():
        raise CheckpointError(f"no staged checkpoint at {tmp}")
    fsync_tree(tmp)
    old = _old_path(final)
    if final.exists():
        if old.exists():  # a leftover of a commit that completed: NAME is the newer, complete one
            shutil.rmtree(old)
        os.rename(final, old)
        fsync_dir(final.parent)
    # else a crash fell between the renames of an earlier commit: `.old` is the only complete
    # checkpoint, so it stays until the staging directory is in place
    os.rename(tmp, final)
    fsync_dir(final.parent)
    if old.exists():
        shutil.rmtree(old)
    return final


def resolve(path: str | os.PathLike[str]) -> Path:
    """The readable checkpoint for `path`: itself, or the previous one if a replace was interrupted."""
    final = Path(path)
    if final.exists():
        return final
    old = _old_path(final)
    if old.exists():
        return old
    raise CheckpointError(f"checkpoint {final} does not exist")


def write_text(path: str | os.PathLike[str], text: str) -> Path:
    """Replace the file `path` with `text` atomically: a temporary file beside it, flushed to disk,
    then `os.replace`d over it, so a reader or a crash sees the old content or the new, never a
    half-written file. The temporary file is removed if anything fails."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with tmp.open("w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path
