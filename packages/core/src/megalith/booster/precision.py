"""Training precision: fp32, or bf16/fp16 compute with fp32 master weights (fp16 adds loss scaling)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megalith.common.errors import ConfigError
from megalith.optim import DynamicLossScaler

PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Precision:
    name: str = "fp32"
    initial_scale: float = 2.0**16
    growth_interval: int = 1000

    def __post_init__(self) -> None:
        if self.name not in PRECISIONS:
            raise ConfigError(f"precision must be one of {sorted(PRECISIONS)}, got {self.name!r}")

    @property
    def dtype(self) -> torch.dtype:
        return PRECISIONS[self.name]

    @property
    def mixed(self) -> bool:
        return self.name != "fp32"

    @property
    def param_bytes(self) -> int:
        return self.dtype.itemsize

    def make_scaler(self) -> DynamicLossScaler | None:
        if self.name != "fp16":
            return None
        return DynamicLossScaler(scale=self.initial_scale, growth_interval=self.growth_interval)
