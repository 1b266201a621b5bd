"""Starting (or joining) the Ray cluster and waiting on actors with timeouts."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

from megalith.common.errors import DistributedError
from megalith.common.utils import require

logger = logging.getLogger(__name__)


def start_ray(address: str | None, num_cpus: int | None) -> bool:
    """Join ``address``, or start a local loopback-only cluster; returns whether we connected.

    A local cluster gets explicit CPU counts and no dashboard. ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``
    makes Ray bind its services to 127.0.0.1; ``RAY_ENABLE_UV_RUN_RUNTIME_ENV=0`` stops Ray from
    re-creating the ``uv run`` environment for every worker (the workers use this interpreter).
    If Ray is already initialised in this process (e.g. by a test), it is reused and not shut down.
    """
    # read by Ray when it is imported, so set before the first import
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    ray = require("ray")
    if ray.is_initialized():
        return False
    if address:
        ray.init(address=address, include_dashboard=False, log_to_driver=True)
        return True
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    cpus = num_cpus if num_cpus is not None else max(os.cpu_count() or 1, 1)
    ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=True, logging_level=logging.WARNING)
    return True


def wait_all(
    refs: Mapping[str, Any], timeout_s: float, watch: Mapping[str, Any] | None = None, what: str = "call"
) -> dict[str, Any]:
    """Results of named object refs; fails fast, naming the actor, if any ref (or a watched one) fails.

    ``watch`` holds long-running refs (producer loops): one of them finishing -- normally or with
    an error -- while we wait means that actor stopped, which is an error here.
    """
    ray = require("ray")
    deadline = time.monotonic() + timeout_s
    pending = dict(refs)
    results: dict[str, Any] = {}
    watched = dict(watch or {})
    while pending:
        check_watched(watched)
        ready, _ = ray.wait(list(pending.values()), num_returns=len(pending), timeout=0.2)
        for name in [n for n, r in pending.items() if r in ready]:
            results[name] = get_or_raise(pending.pop(name), name, what)
        if pending and time.monotonic() > deadline:
            raise DistributedError(f"{what}: timed out after {timeout_s:.0f}s waiting for {sorted(pending)}")
    return results


def get_or_raise(ref: Any, name: str, what: str) -> Any:
    ray = require("ray")
    try:
        return ray.get(ref, timeout=0)
    except ray.exceptions.RayActorError as exc:
        raise DistributedError(f"{name} died during {what}: {_short(exc)}") from exc
    except ray.exceptions.RayTaskError as exc:
        raise DistributedError(f"{name} failed during {what}: {_short(exc)}") from exc


def check_watched(watched: Mapping[str, Any]) -> None:
    """Raise if a long-running actor loop has ended (crashed, killed, or returned early)."""
    if not watched:
        return
    ray = require("ray")
    ready, _ = ray.wait(list(watched.values()), num_returns=len(watched), timeout=0)
    for name, ref in watched.items():
        if ref in ready:
            get_or_raise(ref, name, "the rollout loop")
            raise DistributedError(f"{name} stopped producing unexpectedly")


def _short(exc: BaseException, limit: int = 600) -> str:
    text = str(exc).strip().splitlines()
    tail = " | ".join(line.strip() for line in text[-4:] if line.strip())
    return (tail or type(exc).__name__)[:limit]


def kill_all(handles: Sequence[Any]) -> None:
    """Force-stop actors we created (errors ignored: they may already be dead)."""
    ray = require("ray")
    for handle in handles:
        try:
            ray.kill(handle, no_restart=True)
        except (ValueError, ray.exceptions.RayError) as exc:
            logger.debug("kill: %s", exc)
