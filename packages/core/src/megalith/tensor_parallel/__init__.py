"""Tensor and sequence parallelism applied from outside the model (layer 5).

Megatron-style column/row-parallel linears, vocabulary-parallel embedding / LM head /
cross-entropy, sequence parallelism (Megatron-SP `split_gather`, Ulysses `all_to_all`), the dropout RNG tracker
(`rng.py`: per-tp-rank streams in sharded regions) and
`apply_tensor_parallel(model, plan, group)` that swaps modules by name pattern.
"""

from megalith.tensor_parallel.apply import (
    STYLES,
    TensorParallelInfo,
    TensorParallelPlan,
    apply_tensor_parallel,
    rank_rng_patterns,
    resolve_plan,
    validate_plan,
)
from megalith.tensor_parallel.checkpoint import (
    ShardedDCPReader,
    ShardedPieceReader,
    full_model_pieces,
    full_shapes,
    full_state_dict,
    gather_optimizer_pieces,
    load_full_pieces,
)
from megalith.tensor_parallel.comm import (
    all_to_all,
    copy_to_tp,
    gather_from_tp,
    gather_sequence,
    reduce_from_tp,
    reduce_scatter_sequence,
    scatter_to_tp,
    split_sequence,
)
from megalith.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, ShardSpec, shard_spec
from megalith.tensor_parallel.rng import (
    TensorParallelRNG,
    attach_rank_rng,
    dropout_rate,
    seed_tensor_parallel_rng,
)
from megalith.tensor_parallel.sequence import SEQUENCE_MODES, check_sequence_length, sequence_sharded_lm_loss
from megalith.tensor_parallel.vocab import (
    VocabParallelEmbedding,
    VocabParallelLMHead,
    causal_lm_loss,
    vocab_parallel_cross_entropy,
)

__all__ = [
    "SEQUENCE_MODES",
    "STYLES",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "ShardSpec",
    "ShardedDCPReader",
    "ShardedPieceReader",
    "TensorParallelInfo",
    "TensorParallelPlan",
    "TensorParallelRNG",
    "VocabParallelEmbedding",
    "VocabParallelLMHead",
    "all_to_all",
    "apply_tensor_parallel",
    "attach_rank_rng",
    "dropout_rate",
    "causal_lm_loss",
    "check_sequence_length",
    "copy_to_tp",
    "full_model_pieces",
    "full_shapes",
    "full_state_dict",
    "gather_from_tp",
    "gather_optimizer_pieces",
    "gather_sequence",
    "load_full_pieces",
    "reduce_from_tp",
    "reduce_scatter_sequence",
    "rank_rng_patterns",
    "resolve_plan",
    "scatter_to_tp",
    "seed_tensor_parallel_rng",
    "sequence_sharded_lm_loss",
    "shard_spec",
    "split_sequence",
    "validate_plan",
    "vocab_parallel_cross_entropy",
]
