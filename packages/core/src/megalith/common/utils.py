"""Small utilities shared by every layer."""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType

from megalith.common.errors import MissingDependencyError


def require(module: str, extra: str | None = None) -> ModuleType:
    """Import an optional heavy dependency, or raise a clear 'install X' error."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        hint = f"pip install 'megalith[{extra}]'" if extra else f"pip install {module.split('.')[0]}"
        raise MissingDependencyError(f"{module!r} is required for this feature: {hint}") from exc


# Ports that `bind(("127.0.0.1", 0))` and outgoing connections are never given (the kernel hands
# those out from `ip_local_port_range`, 32768-60999 by default) and that Ray's worker ports
# (10002-19999) leave alone.
_PICK_LOW, _PICK_HIGH = 20000, 32767


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_loopback_port() -> int:
    """A TCP port that is free on 127.0.0.1 right now and that the kernel will not hand out.

    A port from `bind(0)` comes from the ephemeral range, where any socket opened before the
    caller binds it (a gloo pair, a client connection's source port) can take it first. This picks
    a random free port below that range instead, so only another explicit bind can race it.
    """
    import random
    import socket

    candidates = range(_PICK_LOW, min(_PICK_HIGH, _ephemeral_low() - 1) + 1)  # empty if the ranges overlap
    for port in random.SystemRandom().sample(candidates, k=min(64, len(candidates))):  # fork-safe
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # no quiet range: take the kernel's
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
