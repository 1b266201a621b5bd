"""Shared helpers for benchmark scripts: machine/version info, result writing, and the
``RESULT <json>`` line by which a benchmark's child process hands its measurement back."""

from __future__ import annotations

import datetime as _dt
import importlib.util
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
WORKSPACE = Path(__file__).resolve().parent.parent
PACKAGES = {"megalith": "core", "megalith_chat": "chat", "megalith_llama": "llama", "megalith_qa": "qa"}


def use_workspace_sources() -> list[str]:
    """Put the source folder of each workspace package that is not installed on ``sys.path``, so
    ``python3 benchmarks/X.py`` runs from a plain checkout with any Python that has torch (a GPU
    machine's system Python, no ``uv sync``). The child processes a benchmark starts import this
    module too, so they find the same packages. Installed packages (``uv run``) are left alone.
    Returns the folders added."""
    added = []
    for module, folder in PACKAGES.items():
        src = WORKSPACE / "packages" / folder / "src"
        if importlib.util.find_spec(module) is None and src.is_dir():
            sys.path.insert(0, str(src))
            added.append(str(src))
    return added


use_workspace_sources()


def environment() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        "cpus": len(os.sched_getaffinity(0)),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    return info


def card() -> str:
    """The GPU's short name for result files ("h200", "h100", "a100"; "cuda" if the name has none,
    "cpu" without a GPU), so that a run on another card never overwrites the H200's figures."""
    import re

    import torch

    if not torch.cuda.is_available():
        return "cpu"
    found = re.search(r"\b([A-Z]\d{1,3})\b", torch.cuda.get_device_name(0))
    return found.group(1).lower() if found else "cuda"


def result_name(stem: str, device: str) -> str:
    """``{stem}_{card}.json`` for a CUDA run, ``{stem}_cpu.json`` otherwise."""
    return f"{stem}_{card() if device == 'cuda' else 'cpu'}.json"


def write_result(name: str, payload: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / name
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"environment": environment(), **payload}, indent=2, sort_keys=True))
    os.replace(tmp, path)
    return path


RESULT_TAG = "RESULT "


def emit_result(value: Any) -> None:
    """Print ``value`` as the child process's result line (read back by :func:`run_child`)."""
    print(RESULT_TAG + json.dumps(value), flush=True)


def run_child(
    cmd: list[str], timeout: float, env: dict[str, str] | None = None
) -> tuple[Any, subprocess.CompletedProcess[str]]:
    """Run a benchmark child process; returns its last result line parsed (None if the process
    failed or printed none) and the finished process (for its stderr)."""
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_TAG)]
    if proc.returncode or not lines:
        return None, proc
    return json.loads(lines[-1][len(RESULT_TAG) :]), proc
