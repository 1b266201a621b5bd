"""ZeRO configuration (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training
Trillion Parameter Models")."""

from __future__ import annotations

from dataclasses import dataclass

from megalith.common.errors import ConfigError

SUPPORTED_STAGES = (1, 2)


@dataclass(frozen=True)
class ZeroConfig:
    """stage 1 shards optimizer states (and fp32 masters); stage 2 also shards gradients.

    bucket_size_mb: size bound of one flat bucket (the unit of reduce-scatter / all-gather).
    overlap_communication: launch each bucket's reduce-scatter from backward hooks as it fills.
        None (default) = on for CUDA, off for CPU: with gloo the communication thread competes with
        compute for the same cores, so overlap slows CPU training (benchmarks/zero_vs_ddp.py).
    cpu_offload: keep fp32 masters and optimizer states in host memory and update there.
    """

    stage: int = 2
    bucket_size_mb: float = 25.0
    overlap_communication: bool | None = None
    cpu_offload: bool = False

    def __post_init__(self) -> None:
        if self.stage not in SUPPORTED_STAGES:
            raise ConfigError(f"ZeRO stage must be one of {SUPPORTED_STAGES}, got {self.stage!r}")
        if not self.bucket_size_mb > 0:
            raise ConfigError(f"bucket_size_mb must be > 0, got {self.bucket_size_mb}")

    def bucket_numel(self, element_size: int) -> int:
        return max(1, int(self.bucket_size_mb * 2**20) // element_size)
