"""Training precision: fp32; bf16/fp16 compute with fp32 master weights (fp16 adds loss scaling); or
"bf16-true": weights, gradients and optimizer states all in bf16, no masters (what a model cast to
bf16 and a plain torch optimizer do — half the model-state memory of "bf16", less exact updates)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megalith.common.errors import ConfigError
from megalith.optim import DynamicLossScaler

PRECISIONS = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "bf16-true": torch.bfloat16,
}


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
        """Low-precision compute with fp32 master weights ("bf16", "fp16")."""
        return self.name in ("bf16", "fp16")

    @property
    def param_bytes(self) -> int:
        return self.dtype.itemsize

    @property
    def state_bytes(self) -> int:
        """Bytes of one optimizer-state element (Adam keeps two per parameter): fp32 but under "bf16-true"."""
        return 2 if self.name == "bf16-true" else 4

    @property
    def master_dtype(self) -> torch.dtype:
        """The dtype the optimizer updates: fp32 masters under mixed precision, else the parameters' own."""
        return torch.float32 if self.mixed else self.dtype

    def make_scaler(self) -> DynamicLossScaler | None:
        if self.name != "fp16":
            return None
        return DynamicLossScaler(scale=self.initial_scale, growth_interval=self.growth_interval)
