"""`TrainConfig`: every setting of a training run, validated when built.

Kept free of torch (errors and registries are imported when a config is validated) so that building
the command line, which reads the defaults, stays fast.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from types import SimpleNamespace
from typing import Any


@dataclass(frozen=True)
class TrainConfig:
    """Everything a training run needs (the CLI flags map one to one)."""

    model: str | None = None
    tokenizer: str | None = None
    data: str | None = None
    output: str = "runs/llama-pretrain"
    data_dir: str | None = None
    plugin: str = "zero2"
    precision: str = "fp32"
    lr: float = 3e-5
    min_lr_ratio: float = 0.1
    warmup_steps: int = 2
    schedule: str = "cosine"
    decay_fraction: float = 0.2
    weight_decay: float = 0.01
    grad_accum: int = 1
    batch_size: int = 2
    seq_len: int = 256
    max_steps: int = 20
    max_tokens: int | None = None
    clip: float = 1.0  # 0 turns clipping off
    save_every: int = 10
    keep_checkpoints: int = 2
    resume: str | None = None
    overwrite: bool = False  # a fresh run may replace the checkpoints of an earlier run in `output`
    eval_every: int = 0
    eval_batches: int = 8
    sft_data: str | None = None
    neftune_alpha: float = 0.0
    tp: int = 1
    sp_mode: str = "none"
    pp: int = 1
    pp_schedule: str = "1f1b"
    num_microbatches: int | None = None
    lora: bool = False
    lora_rank: int = 8
    seed: int = 0
    device: str = "auto"
    log_every: int = 1
    kernels: str = "none"
    compile: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        from megalith.common.errors import ConfigError

        self._check_numbers()
        if self.overwrite and self.resume is not None:
            raise ConfigError(
                f"--overwrite starts a fresh run; it cannot be combined with --resume {self.resume}"
            )
        if self.schedule not in ("cosine", "wsd", "constant"):
            raise ConfigError(f"--schedule must be cosine, wsd or constant, got {self.schedule!r}")
        if self.pp < 1:
            raise ConfigError(f"--pp must be >= 1, got {self.pp}")
        from megalith.booster.plugins import check_plugin_name

        check_plugin_name(self.plugin)
        kernel_names(self.kernels)  # raises on an unknown name
        if self.kernels != "none" and (self.tp > 1 or self.pp > 1 or self.lora):
            raise ConfigError(
                f"--kernels {self.kernels} works with --tp 1 --pp 1 and without --lora "
                f"(got --tp {self.tp} --pp {self.pp}{' --lora' if self.lora else ''})"
            )
        if self.pp > 1:
            from megalith_llama.pp import resolve_microbatches

            resolve_microbatches(self.pp, self.batch_size, self.num_microbatches)

    def _check_numbers(self) -> None:
        """Each numeric flag in its range (written so that NaN fails too): a ConfigError naming it."""
        from megalith.common.errors import ConfigError

        positive = (
            "lr", "grad_accum", "batch_size", "seq_len", "max_steps", "save_every", "eval_batches",
            "keep_checkpoints",
        )  # fmt: skip
        for name in positive:
            if not getattr(self, name) > 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be > 0, got {getattr(self, name)}")
        if not self.clip >= 0:
            raise ConfigError(f"--clip must be >= 0 (0 turns clipping off), got {self.clip}")
        for name in ("weight_decay", "warmup_steps", "neftune_alpha"):
            if not getattr(self, name) >= 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"--min-lr-ratio must be in [0, 1], got {self.min_lr_ratio}")
        if not 0 < self.decay_fraction <= 1:
            raise ConfigError(f"--decay-fraction must be in (0, 1], got {self.decay_fraction}")
        if self.max_tokens is not None and not self.max_tokens > 0:
            raise ConfigError(f"--max-tokens must be > 0, got {self.max_tokens}")


def kernel_names(spec: str) -> frozenset[str]:
    """`--kernels`: "none", "all" or a comma-separated subset of `megalith.policies.kernels.KERNELS`."""
    if spec == "none":
        return frozenset()
    from megalith.common.errors import ConfigError
    from megalith.policies.kernels import kernel_set

    try:
        return kernel_set(None if spec == "all" else [n.strip() for n in spec.split(",") if n.strip()])
    except ConfigError as exc:
        raise ConfigError(f"--kernels {spec!r}: {exc}") from None


def defaults() -> SimpleNamespace:
    """The default of every field, read without building (and so validating) a config."""
    return SimpleNamespace(**{f.name: f.default for f in fields(TrainConfig) if f.default is not MISSING})
