"""ZeRO stage 1 and 2 (layer 5)."""

from megalith.zero.buckets import FlatBucket, make_buckets
from megalith.zero.config import ZeroConfig
from megalith.zero.optimizer import ZeroOptimizer, named_parameter_map

__all__ = ["FlatBucket", "ZeroConfig", "ZeroOptimizer", "make_buckets", "named_parameter_map"]
