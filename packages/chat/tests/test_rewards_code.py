"""Sandboxed code execution and the code reward (all runs are bounded by short time limits)."""

from __future__ import annotations

import socket
import time

import pytest

from megalith.common.errors import ConfigError, DataError
from megalith_chat.rewards import CodeReward, SandboxLimits, extract_code, run_python_sandboxed

FAST = SandboxLimits(timeout_s=10.0, memory_mb=256)


def test_sandbox_runs_code_with_stdin() -> None:
    result = run_python_sandboxed(
        "import sys\nprint(sum(int(x) for x in sys.stdin.read().split()))", "2 3 4", FAST
    )
    assert result.ok and result.stdout.strip() == "9"


def test_sandbox_strips_environment_and_uses_private_tmp_dir(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SECRET_TOKEN", "hunter2")
    code = "import os, sys\nprint(sorted(os.environ))\nprint(os.getcwd())\nprint(sys.flags.isolated)"
    result = run_python_sandboxed(code, "", FAST)
    env_keys, cwd, isolated = result.stdout.strip().splitlines()
    assert "SECRET_TOKEN" not in env_keys and "hunter2" not in result.stdout
    assert "megalith-sandbox-" in cwd
    assert isolated == "1"
    import os

    assert not os.path.exists(cwd)  # the working directory is removed afterwards


def test_sandbox_kills_infinite_loop_within_time_limit() -> None:
    start = time.monotonic()
    result = run_python_sandboxed("while True:\n    pass", "", SandboxLimits(timeout_s=1.0))
    assert time.monotonic() - start < 8.0
    assert result.timed_out and result.returncode is None and not result.ok


def test_sandbox_memory_limit() -> None:
    result = run_python_sandboxed("x = bytearray(2 * 1024**3)\nprint('allocated')", "", FAST)
    assert not result.ok and "MemoryError" in result.stderr and "allocated" not in result.stdout


def test_sandbox_output_is_bounded() -> None:
    result = run_python_sandboxed(
        "while True:\n    print('x' * 10000)", "", SandboxLimits(timeout_s=10, output_mb=1)
    )
    assert not result.ok
    assert len(result.stdout) <= 1024 * 1024


def test_sandbox_network_when_isolation_available() -> None:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    try:
        code = (
            f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')"
        )
        result = run_python_sandboxed(code, "", FAST)
    finally:
        server.close()
    if not result.network_isolated:
        pytest.skip("unshare --net is not available on this host; network is not isolated")
    assert "connected" not in result.stdout and result.returncode != 0


def test_sandbox_limits_validate() -> None:
    with pytest.raises(ConfigError, match="memory_mb=8"):
        SandboxLimits(memory_mb=8)


def test_extract_code() -> None:
    text = "first\n```python\nprint(1)\n```\nthen\n```py\nprint(2)\n```"
    assert extract_code(text) == "print(2)\n"
    assert extract_code("<answer>print(3)</answer>") == "print(3)"
    assert extract_code("just words") is None


def test_code_reward_with_asserts() -> None:
    reward = CodeReward(FAST)
    sample = {"tests": "assert square(3) == 9\nassert square(-2) == 4"}
    assert reward("```python\ndef square(x):\n    return x * x\n```", sample) == 1.0
    assert reward("```python\ndef square(x):\n    return x + x\n```", sample) == 0.0
    assert reward("I cannot write code", sample) == 0.0


def test_code_reward_with_stdin_cases() -> None:
    reward = CodeReward(FAST)
    cases = [
        {"stdin": "1 2", "stdout": "3"},
        {"stdin": "5 5", "stdout": "10"},
        {"stdin": "2 2", "stdout": "5"},
    ]
    code = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    assert reward(code, {"cases": cases}) == pytest.approx(2 / 3)


def test_code_reward_bad_records() -> None:
    reward = CodeReward(FAST)
    with pytest.raises(DataError, match="'tests' or 'cases'"):
        reward("```python\npass\n```", {"prompt": "p"})
    with pytest.raises(DataError, match="stdout"):
        reward("```python\npass\n```", {"cases": [{"stdin": ""}]})
