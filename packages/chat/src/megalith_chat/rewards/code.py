"""Code reward: run the completion's Python in a sandboxed subprocess against tests.

What the sandbox does (and does not) isolate -- it limits accidents, it is not a security
boundary for adversarial code; run untrusted workloads inside a container or VM as well:

* **isolated**: a fresh interpreter in isolated mode (``python -I``: no ``PYTHON*`` env vars, no
  user site-packages, the script's directory not on ``sys.path``); a stripped environment
  (only ``PATH``, ``LANG``, ``HOME``/``TMPDIR`` pointing at a private temporary working
  directory, which is deleted afterwards); ``RLIMIT_AS`` (memory), ``RLIMIT_CPU``,
  ``RLIMIT_FSIZE`` (bounds written files *and* captured stdout/stderr), ``RLIMIT_CORE=0``; a
  wall-clock timeout after which the whole process group is killed; and **no network** when
  ``unshare --net --map-root-user`` works on the host (``SandboxResult.network_isolated`` says
  whether it did).
* **not isolated**: the filesystem (the code can read files the user can read and write where
  the user can, by absolute path), other processes of the user (signals, ``/proc``), child
  processes that escape the process group with ``setsid``, and the network when ``unshare``
  is unavailable (e.g. unprivileged user namespaces disabled).
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megalith.common.errors import ConfigError, DataError

_LAUNCHER = """
import resource, runpy, sys
mem, fsize, cpu = (int(v) for v in sys.argv[1:4])
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
sys.argv = ["solution.py"]
runpy.run_path("solution.py", run_name="__main__")
"""
_FENCED_RE = re.compile(r"```(?:python|py)?[^\n]*\n(.*?)```", re.DOTALL)


@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits for one sandboxed run."""

    timeout_s: float = 5.0
    memory_mb: int = 512
    output_mb: int = 8
    isolate_network: bool = True

    def __post_init__(self) -> None:
        if self.timeout_s <= 0 or self.memory_mb < 32 or self.output_mb < 1:
            raise ConfigError(f"need timeout_s > 0, memory_mb >= 32, output_mb >= 1; got {self}")


@dataclass(frozen=True)
class SandboxResult:
    """Exit status (``None`` after a timeout kill) and captured output of a sandboxed run."""

    returncode: int | None
    stdout: str
    stderr: str
    timed_out: bool
    network_isolated: bool

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


@functools.lru_cache(maxsize=1)
def network_isolation_available() -> bool:
    """Whether ``unshare --net --map-root-user`` can create a network namespace on this host."""
    exe = shutil.which("unshare")
    if exe is None:
        return False
    try:
        probe = subprocess.run([exe, "--net", "--map-root-user", "true"], capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_python_sandboxed(code: str, stdin: str = "", limits: SandboxLimits | None = None) -> SandboxResult:
    """Run ``code`` as ``__main__`` in a sandboxed interpreter (see module docstring for what that means)."""
    limits = limits or SandboxLimits()
    isolate_net = limits.isolate_network and network_isolation_available()
    with tempfile.TemporaryDirectory(prefix="megalith-sandbox-") as tmp:
        work = Path(tmp)
        (work / "solution.py").write_text(code, encoding="utf-8")
        (work / "stdin.txt").write_text(stdin, encoding="utf-8")
        cpu_s = max(1, int(limits.timeout_s) + 1)
        cmd = [
            sys.executable,
            "-I",
            "-c",
            _LAUNCHER,
            str(limits.memory_mb << 20),
            str(limits.output_mb << 20),
        ]
        cmd.append(str(cpu_s))
        if isolate_net:
            cmd = [shutil.which("unshare") or "unshare", "--net", "--map-root-user", *cmd]
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": tmp, "TMPDIR": tmp, "PYTHONHASHSEED": "0"}
        with (
            open(work / "stdin.txt", "rb") as fin,
            open(work / "stdout.txt", "wb") as fout,
            open(work / "stderr.txt", "wb") as ferr,
        ):
            proc = subprocess.Popen(
                cmd, cwd=tmp, stdin=fin, stdout=fout, stderr=ferr, env=env, start_new_session=True
            )
            try:
                returncode: int | None = proc.wait(timeout=limits.timeout_s)
            except subprocess.TimeoutExpired:
                returncode = None
            finally:
                _kill_group(proc)  # also reaps background children left in the group
                proc.wait()
        read = functools.partial(_read_capped, limit=limits.output_mb << 20)
        return SandboxResult(
            returncode, read(work / "stdout.txt"), read(work / "stderr.txt"), returncode is None, isolate_net
        )


def _read_capped(path: Path, limit: int) -> str:
    with open(path, "rb") as f:
        return f.read(limit).decode("utf-8", errors="replace")


def extract_code(completion: str) -> str | None:
    """The last fenced code block (```` ```python ... ``` ````), else the ``<answer>`` content, else ``None``."""
    blocks = _FENCED_RE.findall(completion)
    if blocks:
        return str(blocks[-1])
    from megalith_chat.rewards.math_answer import extract_answer

    return extract_answer(completion)


@dataclass(frozen=True)
class CodeReward:
    """Reward for code completions, picklable (usable with process isolation).

    The prompt record carries either ``tests`` -- Python source (e.g. ``assert f(2) == 4``)
    appended to the solution; reward 1.0 if the run exits with 0, else 0.0 -- or ``cases`` -- a
    list of ``{"stdin": str, "stdout": str}``; reward = fraction of cases whose stripped stdout
    equals the expected one. A completion with no code scores 0.0.
    """

    limits: SandboxLimits = field(default_factory=SandboxLimits)

    def __call__(self, completion: str, sample: Mapping[str, Any]) -> float:
        code = extract_code(completion)
        tests, cases = sample.get("tests"), sample.get("cases")
        if tests is None and cases is None:
            raise DataError(
                f"code reward needs 'tests' or 'cases' in the prompt record, got keys {sorted(sample)}"
            )
        if code is None:
            return 0.0
        if tests is not None:
            return 1.0 if run_python_sandboxed(f"{code}\n\n{tests}\n", "", self.limits).ok else 0.0
        return self._score_cases(code, cases)

    def _score_cases(self, code: str, cases: Any) -> float:
        if not isinstance(cases, Sequence) or not cases:
            raise DataError(
                f"'cases' must be a non-empty list of {{'stdin', 'stdout'}} objects, got {cases!r}"
            )
        passed = 0
        for case in cases:
            if not isinstance(case, Mapping) or "stdout" not in case:
                raise DataError(f"each case needs a 'stdout' field, got {case!r}")
            run = run_python_sandboxed(code, str(case.get("stdin", "")), self.limits)
            passed += int(run.ok and run.stdout.strip() == str(case["stdout"]).strip())
        return passed / len(cases)


code_reward = CodeReward()
