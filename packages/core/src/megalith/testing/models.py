"""Tiny models and synthetic data for equivalence tests (fp32, CPU)."""

from __future__ import annotations

import torch
from torch import nn


def tiny_llama_config(vocab_size: int = 131, hidden: int = 32, layers: int = 2, tie: bool = False):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden + 6,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tie,
        attn_implementation="eager",
    )


def tiny_llama(seed: int = 0, **kwargs) -> nn.Module:
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_llama_config(**kwargs))


class WithUnused(nn.Module):
    """A tiny Llama plus a parameter that never receives a gradient (odd-sized, to test padding)."""

    def __init__(self, seed: int = 0, **kwargs) -> None:
        super().__init__()
        self.lm = tiny_llama(seed, **kwargs)
        self.unused = nn.Linear(3, 7)

    def forward(self, input_ids, labels=None):
        return self.lm(input_ids=input_ids, labels=labels)


def synthetic_batches(
    steps: int, batch: int, seq: int, vocab: int = 131, seed: int = 1234
) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (batch, seq), generator=g) for _ in range(steps)]


def lm_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss
