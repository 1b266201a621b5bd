"""Reward evaluation core shared by the in-process runner and the reward worker process.

Deliberately imports only the standard library (not torch, not ``megalith``), so that a spawned
reward worker starts in a fraction of a second and a killed one is replaced quickly.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

RewardFunction = Callable[[str, Mapping[str, Any]], float]
READY = "ready"


@dataclass(frozen=True)
class RewardResult:
    """Outcome of one reward call. ``score`` is 0.0 whenever ``error`` is set."""

    score: float
    error: str | None = None
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(frozen=True)
class RewardRequest:
    """Parent -> worker: evaluate ``fn(completion, sample)``."""

    fn: RewardFunction
    completion: str
    sample: Mapping[str, Any]


def call_reward(fn: RewardFunction, completion: str, sample: Mapping[str, Any]) -> RewardResult:
    """Call ``fn`` and turn any exception or non-finite/non-numeric score into an error result."""
    try:
        score = float(fn(completion, sample))
    # A reward function is user code at a trust boundary: whatever it raises is recorded in the
    # result (and counted by the runner) instead of aborting the rollout.
    except Exception as exc:  # noqa: BLE001
        return RewardResult(0.0, error=f"{type(exc).__name__}: {exc}")
    if not math.isfinite(score):
        return RewardResult(0.0, error=f"non-finite score {score!r}")
    return RewardResult(score)


def worker_main(conn: Connection, memory_mb: int | None) -> None:
    """Worker-process loop: receive :class:`RewardRequest`, send back :class:`RewardResult`; ``None`` stops."""
    if memory_mb is not None:
        import resource

        limit = memory_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    conn.send(READY)
    while True:
        try:
            request = conn.recv()
        except EOFError:
            return
        if request is None:
            return
        conn.send(call_reward(request.fn, request.completion, request.sample))
