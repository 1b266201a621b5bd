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


def run_triton(script: str, interpret: bool, timeout: float = 600) -> str:
    """stdout of ``script`` (:func:`run_python`) with the Triton interpreter on (kernels run on the
    CPU) or off (e.g. to compile for a GPU that is not there); skips the test without Triton."""
    import pytest

    pytest.importorskip("triton")
    return run_python(script, {"TRITON_INTERPRET": "1" if interpret else None}, timeout)
