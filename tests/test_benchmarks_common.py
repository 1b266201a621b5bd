"""benchmarks/_common.py: a benchmark started from a plain checkout finds the workspace's packages."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _load_common() -> ModuleType:
    spec = importlib.util.spec_from_file_location("_bench_common", ROOT / "benchmarks" / "_common.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_installed_packages_leave_sys_path_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    common = _load_common()
    monkeypatch.setattr(sys, "path", list(sys.path))
    before = list(sys.path)
    assert common.use_workspace_sources() == []  # `uv run`: all four packages are installed
    assert sys.path == before


def test_missing_packages_are_found_in_the_workspace_sources(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the packages installed (a GPU machine's system Python), each missing package's
    ``src`` folder goes first on ``sys.path``; installed ones add nothing."""
    common = _load_common()
    monkeypatch.setattr(sys, "path", list(sys.path))
    real_find_spec = importlib.util.find_spec
    missing = {"megalith_chat", "megalith_qa"}

    def find_spec(name: str, *args: object) -> object:
        return None if name in missing else real_find_spec(name, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    added = common.use_workspace_sources()
    expected = [str(ROOT / "packages" / "chat" / "src"), str(ROOT / "packages" / "qa" / "src")]
    assert sorted(added) == sorted(expected)
    assert sorted(sys.path[:2]) == sorted(expected)
