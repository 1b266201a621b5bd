"""Query, key and value projections of HF Llama / Qwen2 / Mistral attention as one matmul.

With grouped-query attention the key and value projections are narrow (TinyLlama-1.1B: 256
outputs against 2048 for the query), and their backward matmuls (input gradient with an inner
dimension of 256, weight gradients with 256 rows) keep a GPU's tensor cores poorly fed. Running
``x [W_q; W_k; W_v]ᵀ`` as one matmul over the concatenated weights instead makes one wide forward
and two well-shaped backward products; the concatenation (and the split of its gradient) copies
the ~10 MB of weights per layer, which costs far less. One TinyLlama layer on an H200 (16384
tokens, bf16, `benchmarks/gpu_qkv.py`): forward + backward of the three projections 0.88 ms
separately, 0.77 ms fused (the forward alone is the same, 0.25 ms); the same fusion of the MLP's
gate and up projections (5632 outputs each) gains nothing, so only attention is fused.

The parameters themselves are untouched (names, sharding, optimizer state and checkpoints stay
as they are): `fused_qkv_forward` only replaces the attention module's ``forward``, keeping its
arguments, its KV-cache update and its result.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def fusable_attention(module: nn.Module) -> bool:
    """Plain ``nn.Linear`` q/k/v projections, all with or all without a bias."""
    projections = [getattr(module, n, None) for n in ("q_proj", "k_proj", "v_proj")]
    if not all(type(p) is nn.Linear for p in projections):
        return False
    return len({p.bias is None for p in projections}) == 1  # type: ignore[union-attr]


def _sliding_window(module: Any) -> dict[str, Any]:
    """What the family's own forward passes to the attention function (Llama: nothing)."""
    name = type(module).__name__
    if name.startswith("Qwen2"):
        return {"sliding_window": module.sliding_window}
    if name.startswith("Mistral"):
        return {"sliding_window": getattr(module.config, "sliding_window", None)}
    return {}


def _update_cache(module: Any, kwargs: dict[str, Any], key: torch.Tensor, value: torch.Tensor) -> Any:
    """Append to the KV cache as the family's forward does (the argument was renamed from
    ``past_key_values`` to ``cache`` in transformers 5.2x, and the update then took the kwargs)."""
    cache = kwargs.pop("cache", None)
    if cache is not None:
        return cache.update(key, value, module.layer_idx, kwargs=kwargs)
    cache = kwargs.pop("past_key_values", None)
    if cache is not None:
        return cache.update(key, value, module.layer_idx)
    return key, value


def fused_qkv_forward(
    self: Any,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, Any]:
    """The HF attention forward (same arguments, same result) with one q/k/v matmul."""
    q, k, v = self.q_proj, self.k_proj, self.v_proj
    weight = torch.cat((q.weight, k.weight, v.weight))
    bias = None if q.bias is None else torch.cat((q.bias, k.bias, v.bias))
    qkv = F.linear(hidden_states, weight, bias)
    input_shape = hidden_states.shape[:-1]
    heads = (*input_shape, -1, self.head_dim)
    query, key, value = (
        t.view(heads).transpose(1, 2)
        for t in qkv.split([q.out_features, k.out_features, v.out_features], dim=-1)
    )
    hf = sys.modules[type(self).__module__]  # the family's modeling module, patched functions included
    query, key = hf.apply_rotary_pos_emb(query, key, *position_embeddings)  # type: ignore[misc]
    key, value = _update_cache(self, kwargs, key, value)
    attention = hf.ALL_ATTENTION_FUNCTIONS.get_interface(
        self.config._attn_implementation, hf.eager_attention_forward
    )
    out, weights = attention(
        self,
        query,
        key,
        value,
        attention_mask,
        dropout=0.0 if not self.training else self.attention_dropout,
        scaling=self.scaling,
        **_sliding_window(self),
        **kwargs,
    )
    return self.o_proj(out.reshape(*input_shape, -1).contiguous()), weights
