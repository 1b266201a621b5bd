"""Small utilities shared by every layer."""

from __future__ import annotations

import importlib
from types import ModuleType

from megalith.common.errors import MissingDependencyError


def require(module: str, extra: str | None = None) -> ModuleType:
    """Import an optional heavy dependency, or raise a clear 'install X' error."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        hint = f"pip install 'megalith[{extra}]'" if extra else f"pip install {module.split('.')[0]}"
        raise MissingDependencyError(f"{module!r} is required for this feature: {hint}") from exc


def free_loopback_port() -> int:
    """A TCP port that is free on 127.0.0.1 right now."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
