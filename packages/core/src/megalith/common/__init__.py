"""Errors, rank-aware logging, device abstraction and small utilities (layer 1)."""

from megalith.common.device import Device, get_device
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
