"""Process-group start-up: join a torchrun-style environment, or run as a single process."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from megalith.common.device import Device, get_device
from megalith.common.errors import ConfigError

DEFAULT_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class LaunchInfo:
    rank: int
    world_size: int
    local_rank: int
    device: Device

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1 or dist.is_initialized()


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError as exc:
        raise ConfigError(f"environment variable {name}={raw!r} is not an integer") from exc


def launch(device: str = "auto", timeout_s: float = DEFAULT_TIMEOUT_S) -> LaunchInfo:
    """Initialise the default process group from the torchrun environment.

    With no `WORLD_SIZE` in the environment (or `WORLD_SIZE=1`) this is a no-op apart from
    picking the device. Every collective on the group fails after `timeout_s` instead of hanging.
    """
    dev = get_device(device)
    world_size = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0)
    local_rank = _env_int("LOCAL_RANK", 0)
    if world_size > 1 and not dist.is_initialized():
        if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
            raise ConfigError(f"WORLD_SIZE={world_size} but MASTER_ADDR/MASTER_PORT are not set")
        if dev.type == "cuda":
            import torch

            torch.cuda.set_device(dev.index)
        dist.init_process_group(
            backend=dev.backend,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )
    if dist.is_initialized():
        rank, world_size = dist.get_rank(), dist.get_world_size()
    return LaunchInfo(rank=rank, world_size=world_size, local_rank=local_rank, device=dev)


def under_launcher() -> bool:
    """True inside a torchrun-style launch (RANK and WORLD_SIZE set by a launcher)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def relaunch(nproc_per_node: int, argv: list[str], module: str | None = None) -> int:
    """Run this program again under `torch.distributed.run` with `nproc_per_node` local ranks on loopback.

    `argv` are the program's arguments; `module` runs `python -m module` instead of the script in
    `sys.argv[0]`. Returns the launcher's exit code: a failed rank's (`megalith.distributed.torchrun`
    reports the failed ranks in one line). Callers do this only when not `under_launcher()`.
    """
    import subprocess
    import sys

    from megalith.common.utils import free_loopback_port

    if nproc_per_node < 1:
        raise ConfigError(f"--nproc-per-node must be >= 1, got {nproc_per_node}")
    target = ["-m", module] if module else [sys.argv[0]]
    cmd = [
        sys.executable,
        "-m",
        "megalith.distributed.torchrun",
        f"--nproc-per-node={nproc_per_node}",
        "--nnodes=1",
        "--node-rank=0",
        "--master-addr=127.0.0.1",
        f"--master-port={free_loopback_port()}",
        *(["--module"] if module else []),
        *(target[1:] if module else target),
        *argv,
    ]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc_per_node)))
    return subprocess.call(cmd, env=env)


def shutdown() -> None:
    """Destroy the default process group if one exists."""
    if dist.is_initialized():
        dist.destroy_process_group()
