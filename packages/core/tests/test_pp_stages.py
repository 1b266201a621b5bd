"""Stage split of HF decoders in one process: chaining every stage's forward gives the model's own
logits for Llama, Qwen2 (per-layer full / sliding-window masks) and Mistral (sliding window), with
activation checkpointing on half of each stage's layers; pruning frees the other stages' modules
and keeps full-model parameter names."""

from __future__ import annotations

import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

from megalith.common.errors import ConfigError, DistributedError
from megalith.pipeline import make_stages, prune, split_microbatches, stage_ranges
from megalith.pipeline.stage import layer_costs
from megalith.testing.models import tiny_llama

COMMON = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "attn_implementation": "eager",
}


def _model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "qwen2":  # layers 2, 3 use a 3-token sliding window
        config = Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=3, max_window_layers=2)
        return Qwen2ForCausalLM(config)
    if kind == "mistral":
        return MistralForCausalLM(MistralConfig(**COMMON, sliding_window=3))
    return tiny_llama(vocab_size=64, layers=4)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
def test_chained_stages_give_the_model_logits(kind: str) -> None:
    model = _model(kind)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    expected = model(input_ids=ids).logits
    ranges = stage_ranges(layer_costs(model), 3)
    assert sorted(len(r) for r in ranges) == [1, 1, 2]  # 4 equal layers over 3 stages
    stages = make_stages(model, ranges, [0, 1, 2], checkpoint_ratio=0.5)
    x = None
    for s in range(3):
        x = stages[s].forward(x, {"input_ids": ids})
    assert x is not None
    torch.testing.assert_close(x, expected, atol=1e-6, rtol=0)
    x.sum().backward()  # checkpointed layers recompute in backward
    assert all(p.grad is not None for p in model.parameters())


def test_prune_keeps_only_held_stages_under_full_names() -> None:
    model = tiny_llama(vocab_size=64, layers=4)
    names = {n for n, _ in model.named_parameters()}
    ranges = stage_ranges(layer_costs(model), 2, [3, 1])
    prune(model, ranges, [1])
    kept = {n for n, _ in model.named_parameters()}
    assert kept == {n for n in names if n.startswith(("model.layers.3.", "model.norm", "lm_head"))}
    with pytest.raises(DistributedError, match="another pipeline rank"):
        model.model.embed_tokens(torch.zeros(1, 1, dtype=torch.long))


def test_microbatch_split() -> None:
    batch = {"input_ids": torch.arange(12).view(6, 2), "tag": "x"}
    mbs = split_microbatches(batch, 3)
    assert [mb["input_ids"].tolist() for mb in mbs] == [
        [[0, 1], [2, 3]],
        [[4, 5], [6, 7]],
        [[8, 9], [10, 11]],
    ]
    assert all(mb["tag"] == "x" for mb in mbs)
    with pytest.raises(ConfigError, match="6 rows, not divisible by num_microbatches=4"):
        split_microbatches(batch, 4)
