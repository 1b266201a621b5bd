"""Device abstraction: CPU is first-class (gloo); CUDA uses NCCL."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from megalith.common.errors import ConfigError


@dataclass(frozen=True)
class Device:
    """The accelerator a process trains on and the collective backend that goes with it."""

    type: str  # "cpu" | "cuda"
    index: int = 0

    def __post_init__(self) -> None:
        if self.type not in ("cpu", "cuda"):
            raise ConfigError(f"device type must be 'cpu' or 'cuda', got {self.type!r}")

    @property
    def backend(self) -> str:
        return "nccl" if self.type == "cuda" else "gloo"

    @property
    def torch(self) -> torch.device:
        return torch.device(self.type, self.index) if self.type == "cuda" else torch.device("cpu")

    def synchronize(self) -> None:
        if self.type == "cuda":
            torch.cuda.synchronize(self.index)


def get_device(kind: str = "auto") -> Device:
    """`auto` picks CUDA (this process's LOCAL_RANK GPU) when available, else CPU."""
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("device 'cuda' requested but torch.cuda.is_available() is False")
        return Device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    return Device(kind)
