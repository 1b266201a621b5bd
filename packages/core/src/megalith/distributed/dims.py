"""`ParallelDims`: the sizes of the dp × pp × sp × tp decomposition, validated without torch.distributed."""

from __future__ import annotations

import numbers
from dataclasses import dataclass

from megalith.common.errors import ConfigError
from megalith.common.validate import check_int

AXES = ("pp", "dp", "sp", "tp")


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of data (dp), pipeline (pp), sequence (sp) and tensor (tp) parallelism.

    `dp * pp * sp * tp` must equal `world_size`. `dp=-1` means "whatever is left". Every size is
    a positive int (a float such as 2.0 or a bool is a ConfigError naming it).
    Validation happens in `__post_init__` from the given world size, so a wrong configuration
    fails before any process group exists.
    """

    world_size: int
    dp: int = -1
    tp: int = 1
    pp: int = 1
    sp: int = 1

    def __post_init__(self) -> None:
        check_int("world_size", self.world_size)
        for axis in ("tp", "pp", "sp"):
            check_int(axis, getattr(self, axis))
        if (
            isinstance(self.dp, bool)
            or not isinstance(self.dp, numbers.Integral)
            or not (self.dp >= 1 or self.dp == -1)
        ):
            raise ConfigError(f"dp must be an integer >= 1 or -1 (infer), got {self.dp!r}")
        others = self.tp * self.pp * self.sp
        if self.dp == -1:
            if self.world_size % others:
                raise ConfigError(
                    f"world_size={self.world_size} is not divisible by tp*pp*sp={self.tp}*{self.pp}*{self.sp}"
                    f"={others}"
                )
            object.__setattr__(self, "dp", self.world_size // others)
        product = self.dp * others
        if product != self.world_size:
            raise ConfigError(
                f"dp*tp*pp*sp = {self.dp}*{self.tp}*{self.pp}*{self.sp} = {product} "
                f"does not equal world_size={self.world_size}"
            )

    @property
    def shape(self) -> tuple[int, ...]:
        """Mesh shape in axis order `AXES` (pp outermost, tp innermost so tp ranks are neighbours)."""
        return tuple(getattr(self, axis) for axis in AXES)
