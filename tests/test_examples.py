"""Smoke tests: the examples run from the command line as a new user would run them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_train_zero_example_runs_on_two_processes():
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train_zero.py"), "--steps", "8", "--seq-len", "32"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "plan: zero2, fp32, world_size=2" in out.stdout
    line = next(row for row in out.stdout.splitlines() if row.startswith("loss "))
    first, last = (float(x) for x in line.split()[1:4:2])
    assert last < first, line


def test_train_zero_example_rejects_bad_flag():
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train_zero.py"), "--stage", "3"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 2 and "invalid choice: 3" in out.stderr
    for flag, value in (("--steps", "0"), ("--nproc-per-node", "0"), ("--lr", "nan"), ("--seq-len", "x")):
        out = subprocess.run(
            [sys.executable, str(ROOT / "examples" / "train_zero.py"), flag, value],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert out.returncode == 2 and f"argument {flag}: must be a number > 0, got '{value}'" in out.stderr
