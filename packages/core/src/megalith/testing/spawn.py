"""Run a function on N gloo ranks from inside pytest.

Ranks are forked (so functions defined in test files work), rendezvous on a free loopback port,
and send their return value or exception back. If one rank raises, the others are given
`timeout_s` to finish (they will usually fail in a collective) and are then killed; the caller
sees the first exception with the rank that raised it. Nothing can hang past `timeout_s`.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from megalith.common.errors import DistributedError
from megalith.common.utils import free_loopback_port

free_port = free_loopback_port  # the name tests import


def _worker(fn, rank, world_size, port, env, pg_timeout_s, result_q, args, kwargs):  # noqa: PLR0913
    os.environ.update(env)
    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1"),
        }
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    try:
        dist.init_process_group(
            "gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=pg_timeout_s)
        )
        out = fn(rank, world_size, *args, **kwargs)
        result_q.put((rank, "ok", _dumps(out)))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which re-raises it
        result_q.put((rank, "err", _dumps_exc(exc)))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except RuntimeError:
                pass
        result_q.close()
        result_q.join_thread()  # flush the result through the pipe before the hard exit
    os._exit(0)


def _dumps(obj: Any) -> bytes:
    return pickle.dumps(obj)


def _dumps_exc(exc: BaseException) -> bytes:
    tb = "".join(traceback.format_exception(exc))
    try:
        return pickle.dumps((exc, tb))
    except Exception:  # noqa: BLE001 - unpicklable exception: send its text instead
        return pickle.dumps((DistributedError(f"{type(exc).__name__}: {exc}"), tb))


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 120.0,
    env: dict[str, str] | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run `fn(rank, world_size, *args, **kwargs)` on `world_size` forked gloo ranks.

    Returns the per-rank return values (rank order). Re-raises the first exception, annotated with
    the rank that raised it and its traceback.
    """
    ctx = mp.get_context("fork")
    result_q = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_worker,
            args=(fn, r, world_size, port, dict(env or {}), timeout_s, result_q, args, kwargs),
            daemon=True,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    try:
        return _collect(procs, result_q, world_size, timeout_s)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=5)


def _collect(procs: list, result_q: Any, world_size: int, timeout_s: float) -> list[Any]:
    results: dict[int, Any] = {}
    first_error: tuple[int, BaseException, str] | None = None
    deadline = time.monotonic() + timeout_s
    while len(results) < world_size and time.monotonic() < deadline:
        try:
            rank, status, payload = result_q.get(timeout=0.2)
        except queue.Empty:
            dead = [i for i, p in enumerate(procs) if not p.is_alive() and i not in results]
            if dead and result_q.empty():
                time.sleep(0.5)  # give a queue put from an exiting process time to land
                if result_q.empty():
                    raise DistributedError(
                        f"rank(s) {dead} died without reporting (exit codes "
                        f"{[procs[i].exitcode for i in dead]})"
                    ) from None
            continue
        if status == "ok":
            results[rank] = pickle.loads(payload)
            continue
        exc, tb = pickle.loads(payload)
        results[rank] = None
        if first_error is None:
            first_error = (rank, exc, tb)
            deadline = min(deadline, time.monotonic() + timeout_s)
    if first_error is not None:
        rank, exc, tb = first_error
        exc.add_note(f"raised on rank {rank}; its traceback:\n{tb}")
        raise exc
    if len(results) < world_size:
        missing = sorted(set(range(world_size)) - set(results))
        raise DistributedError(f"ranks {missing} did not finish within {timeout_s:.0f}s")
    return [results[r] for r in range(world_size)]
