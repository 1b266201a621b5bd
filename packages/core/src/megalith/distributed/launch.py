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


def shutdown() -> None:
    """Destroy the default process group if one exists."""
    if dist.is_initialized():
        dist.destroy_process_group()
