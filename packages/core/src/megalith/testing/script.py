"""Run a Python snippet in a fresh interpreter, e.g. with the Triton interpreter switched on (which
must be chosen before Triton is first imported) or off."""

from __future__ import annotations

import os
import subprocess
import sys


def run_python(script: str, env: dict[str, str | None] | None = None, timeout: float = 300) -> str:
    """stdout of ``script`` run by ``sys.executable``; ``env`` sets variables (``None`` removes
    one). A failing script fails the caller with the end of its stderr."""
    environ = dict(os.environ)
    for key, value in (env or {}).items():
        if value is None:
            environ.pop(key, None)
        else:
            environ[key] = value
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=environ, timeout=timeout
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout
