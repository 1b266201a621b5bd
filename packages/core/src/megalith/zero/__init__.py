"""ZeRO stage 1, 2 and 3, and deterministic (lazy) initialisation (layer 5)."""

from megalith.zero.buckets import FlatBucket, make_buckets
from megalith.zero.config import ZeroConfig
from megalith.zero.optimizer import ZeroOptimizer, named_parameter_map

__all__ = ["FlatBucket", "ZeroConfig", "ZeroOptimizer", "make_buckets", "named_parameter_map"]

from megalith.zero.lazy import deterministic_init, deterministic_values
from megalith.zero.stage3_layout import group_parameters
from megalith.zero.stage3_optim import Zero3Optimizer

__all__ += ["Zero3Optimizer", "deterministic_init", "deterministic_values", "group_parameters"]
