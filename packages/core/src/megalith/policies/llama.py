"""Policy for HF `LlamaForCausalLM` (transformers 5 module names).

Attention: q/k/v column-parallel (heads and KV heads split over tp; HF's attention infers the local
head count from the projection width and keeps num_key_value_groups = H/KV), o_proj row-parallel.
MLP: gate/up column-parallel, down row-parallel. Embedding and LM head vocabulary-parallel (tied
weights stay tied). Under split_gather the decoder norms work on sequence shards.
Dropout: attention (this rank's heads) on the per-tp-rank RNG stream; under sequence parallelism
the whole decoder layers and the final norm too (sequence shards); see megalith.tensor_parallel.rng.
"""

from __future__ import annotations

from megalith.policies.base import Policy
from megalith.tensor_parallel import TensorParallelPlan

DECODER_PLAN = TensorParallelPlan(
    layers={
        "model.embed_tokens": "vocab_embedding",
        "model.layers.*.self_attn.q_proj": "colwise",
        "model.layers.*.self_attn.k_proj": "colwise",
        "model.layers.*.self_attn.v_proj": "colwise",
        "model.layers.*.self_attn.o_proj": "rowwise",
        "model.layers.*.mlp.gate_proj": "colwise",
        "model.layers.*.mlp.up_proj": "colwise",
        "model.layers.*.mlp.down_proj": "rowwise",
        "lm_head": "vocab_head",
    },
    attention="model.layers.*.self_attn",
    attention_projections=("q_proj", "k_proj", "v_proj"),
    attention_output="o_proj",
    mlp="model.layers.*.mlp",
    sequence_start="model.layers.0",
    sequence_norms=(
        "model.layers.*.input_layernorm",
        "model.layers.*.post_attention_layernorm",
        "model.norm",
    ),
    # dropout on sequence shards under SP: the decoder layers and the final norm draw per-rank masks
    sequence_rng=("model.layers.*", "model.norm"),
)

LLAMA = Policy(name="llama", model_classes=("LlamaForCausalLM",), plan=DECODER_PLAN)
