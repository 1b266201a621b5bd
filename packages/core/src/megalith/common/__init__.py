"""Errors, rank-aware logging, device abstraction and small utilities (layer 1)."""

from typing import TYPE_CHECKING, Any

from megalith.common.errors import (
    CheckpointError,
    ConfigError,
    DataError,
    DistributedError,
    MegalithError,
    MissingDependencyError,
)
from megalith.common.logging import get_logger, log_rank0
from megalith.common.utils import require

if TYPE_CHECKING:
    from megalith.common.device import Device, get_device


__all__ = [
    "CheckpointError",
    "ConfigError",
    "DataError",
    "Device",
    "DistributedError",
    "MegalithError",
    "MissingDependencyError",
    "get_device",
    "get_logger",
    "log_rank0",
    "require",
]


def __getattr__(name: str) -> Any:
    """`Device` and `get_device` load torch: imported on first use, so that the errors and logging
    (which command lines import to build their parsers) come without it."""
    if name in ("Device", "get_device"):
        from megalith.common import device

        return getattr(device, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
