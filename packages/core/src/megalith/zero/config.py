"""ZeRO configuration (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training
Trillion Parameter Models")."""

from __future__ import annotations

from dataclasses import dataclass

from megalith.common.errors import ConfigError
from megalith.common.validate import check_bool, check_fraction, check_int, check_positive

SUPPORTED_STAGES = (1, 2, 3)


@dataclass(frozen=True)
class ZeroConfig:
    """stage 1 shards optimizer states (and fp32 masters); stage 2 also shards gradients; stage 3
    also shards the parameters themselves (gathered per module group just before use).

    bucket_size_mb: size bound of one flat bucket (the unit of reduce-scatter / all-gather). Under
        stage 3 it is the size at which a module's not-yet-grouped parameters become their own group.
    overlap_communication: launch each bucket's reduce-scatter from backward hooks as it fills.
        None (default) = on for CUDA, off for CPU: with gloo the communication thread competes with
        compute for the same cores, so overlap slows CPU training (benchmarks/zero_vs_ddp.py).
    cpu_offload: keep fp32 masters and optimizer states in host memory and update there (stages 1-2;
        under stage 3 it means offload_optim_frac=1.0).
    offload_optim_frac: stage 3 — this fraction of the parameter groups (by size, in group order) keep
        their fp32 master, gradient shard and optimizer states in host memory (pinned on CUDA) and are
        updated on the CPU (static placement, as Gemini's).
    offload_param_frac: stage 3 — this fraction of the groups keep their parameter shard in host memory;
        it is copied to the device just before the all-gather.
    prefetch: stage 3 — all-gather the next group (in recorded execution order) while the current one
        computes. None = on for CUDA, off for CPU (same reason as overlap_communication).
    init_seed: stage 3 lazy init — the seed of `megalith.zero.deterministic_init` used to materialise
        the shards of a model built on the meta device.
    """

    stage: int = 2
    bucket_size_mb: float = 25.0
    overlap_communication: bool | None = None
    cpu_offload: bool = False
    offload_optim_frac: float = 0.0
    offload_param_frac: float = 0.0
    prefetch: bool | None = None
    init_seed: int = 0

    def __post_init__(self) -> None:
        stage = self.stage
        if isinstance(stage, bool) or not isinstance(stage, int) or stage not in SUPPORTED_STAGES:  # 2.0 == 2
            raise ConfigError(f"ZeRO stage must be one of {SUPPORTED_STAGES}, got {stage!r}")
        check_positive("bucket_size_mb", self.bucket_size_mb)
        check_bool("overlap_communication", self.overlap_communication, optional=True)
        check_bool("prefetch", self.prefetch, optional=True)
        check_bool("cpu_offload", self.cpu_offload)
        check_int("init_seed", self.init_seed, minimum=0)
        for name in ("offload_optim_frac", "offload_param_frac"):
            value = getattr(self, name)
            check_fraction(name, value)
            if value and self.stage != 3:
                raise ConfigError(f"{name}={value} needs stage=3 (stages 1-2 use cpu_offload=True)")

    def bucket_numel(self, element_size: int) -> int:
        return max(1, int(self.bucket_size_mb * 2**20) // element_size)

    @property
    def optim_offload_fraction(self) -> float:
        """The effective stage-3 optimizer offload fraction (cpu_offload means all of it)."""
        return 1.0 if self.cpu_offload else self.offload_optim_frac
