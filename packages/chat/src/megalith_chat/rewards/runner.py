"""Running reward functions safely: a failure or a timeout scores 0, is flagged, and is counted.

A reward function has the signature ``fn(completion: str, sample: Mapping[str, Any]) -> float``
where ``sample`` is the prompt record (``prompt``, ``answer`` and any extra fields such as
``tests``). :class:`RewardRunner` calls it under a time limit:

* ``isolation="thread"`` (default): the function runs in a daemon thread; on timeout the caller
  gets a result at once, but Python cannot kill a thread, so a runaway function keeps its thread
  (and a CPU core if it spins) until it returns or the process exits.
* ``isolation="process"``: the function runs in a worker process (``spawn``) with an optional
  address-space limit (``memory_mb``, ``RLIMIT_AS``: virtual memory, so allow ~4 GB if the
  function's module imports torch, as the built-in rewards do via ``megalith``); on timeout the
  worker is killed and a fresh one is started on the next call. The function must be picklable
  (a module-level function or an instance of a module-level class).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import pickle
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Literal

from megalith.common.errors import ConfigError
from megalith_chat._reward_worker import (
    READY,
    RewardFunction,
    RewardRequest,
    RewardResult,
    call_reward,
    worker_main,
)

__all__ = ["RewardFunction", "RewardResult", "RewardRunner", "RewardStats"]

logger = logging.getLogger(__name__)

WORKER_STARTUP_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class RewardStats:
    """Counters of a :class:`RewardRunner` since it was created."""

    calls: int
    errors: int
    timeouts: int


class _ProcessWorker:
    """One spawned worker process; killed and replaced when a call times out or it dies."""

    def __init__(self, memory_mb: int | None) -> None:
        self._memory_mb = memory_mb
        self._proc: mp.process.BaseProcess | None = None
        self._conn: Connection | None = None

    def _ensure_started(self) -> Connection | None:
        """Start a worker if none is alive and wait (outside any reward's time limit) until it is ready."""
        if self._proc is not None and self._proc.is_alive() and self._conn is not None:
            return self._conn
        self.close()
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        self._proc = ctx.Process(target=worker_main, args=(child, self._memory_mb), daemon=True)
        self._proc.start()
        child.close()
        self._conn = parent
        try:
            ready = parent.poll(WORKER_STARTUP_TIMEOUT_S) and parent.recv() == READY
        except EOFError:
            ready = False
        if not ready:
            logger.warning("reward worker failed to start (exit code %s)", self._proc.exitcode)
            self.close()
            return None
        return parent

    def call(
        self, fn: RewardFunction, completion: str, sample: Mapping[str, Any], timeout_s: float
    ) -> RewardResult:
        conn = self._ensure_started()
        if conn is None:
            return RewardResult(0.0, error="reward worker process failed to start")
        try:
            conn.send(RewardRequest(fn, completion, sample))
        except (pickle.PicklingError, TypeError, AttributeError) as exc:
            return RewardResult(0.0, error=f"cannot send reward function to worker: {exc}")
        if not conn.poll(timeout_s):
            self.close()
            return RewardResult(0.0, error=f"timed out after {timeout_s:g}s", timed_out=True)
        try:
            result: RewardResult = conn.recv()
        except EOFError:
            exitcode = self._proc.exitcode if self._proc is not None else None
            self.close()
            return RewardResult(0.0, error=f"reward worker died (exit code {exitcode})")
        return result

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self._proc is not None:
            if self._proc.is_alive():
                self._proc.kill()
            self._proc.join(timeout=5)
            self._proc = None


class RewardRunner:
    """Evaluates reward functions with a time limit and counts failures (see module docstring)."""

    def __init__(
        self,
        timeout_s: float = 10.0,
        isolation: Literal["thread", "process"] = "thread",
        memory_mb: int | None = None,
    ) -> None:
        if timeout_s <= 0:
            raise ConfigError(f"reward timeout_s must be > 0, got {timeout_s}")
        if isolation not in ("thread", "process"):
            raise ConfigError(f"reward isolation must be 'thread' or 'process', got {isolation!r}")
        if memory_mb is not None and isolation != "process":
            raise ConfigError(f"memory_mb={memory_mb} needs isolation='process'")
        self.timeout_s = timeout_s
        self.isolation = isolation
        self._worker = _ProcessWorker(memory_mb) if isolation == "process" else None
        self._worker_lock = threading.Lock()  # one request at a time on the worker's pipe
        self._stats_lock = threading.Lock()
        self._calls = self._errors = self._timeouts = 0

    def __call__(self, fn: RewardFunction, completion: str, sample: Mapping[str, Any]) -> RewardResult:
        if self._worker is not None:
            with self._worker_lock:
                result = self._worker.call(fn, completion, sample, self.timeout_s)
        else:
            result = self._run_in_thread(fn, completion, sample)
        self._count(result, getattr(fn, "__name__", type(fn).__name__))
        return result

    def _run_in_thread(self, fn: RewardFunction, completion: str, sample: Mapping[str, Any]) -> RewardResult:
        box: list[RewardResult] = []
        thread = threading.Thread(
            target=lambda: box.append(call_reward(fn, completion, sample)), daemon=True, name="reward-fn"
        )
        thread.start()
        thread.join(self.timeout_s)
        if thread.is_alive() or not box:
            return RewardResult(0.0, error=f"timed out after {self.timeout_s:g}s", timed_out=True)
        return box[0]

    def _count(self, result: RewardResult, name: str) -> None:
        with self._stats_lock:
            self._calls += 1
            self._errors += int(not result.ok)
            self._timeouts += int(result.timed_out)
        if not result.ok:
            logger.debug("reward %s failed: %s", name, result.error)

    @property
    def stats(self) -> RewardStats:
        with self._stats_lock:
            return RewardStats(self._calls, self._errors, self._timeouts)

    def close(self) -> None:
        if self._worker is not None:
            self._worker.close()

    def __enter__(self) -> RewardRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
