"""Where megalith-llama keeps its converted models: the data directory.

Resolution order: an explicit `--data-dir`, then the environment variable `MEGALITH_DATA_DIR`,
then `~/.cache/megalith/llama`.
"""

from __future__ import annotations

import os
from pathlib import Path

DATA_DIR_ENV = "MEGALITH_DATA_DIR"
DEFAULT_DATA_DIR = Path("~/.cache/megalith/llama")


def data_dir(override: str | os.PathLike[str] | None = None) -> Path:
    """The data directory (not created here)."""
    if override is not None:
        return Path(override).expanduser()
    env = os.environ.get(DATA_DIR_ENV)
    if env:
        return Path(env).expanduser()
    return DEFAULT_DATA_DIR.expanduser()
