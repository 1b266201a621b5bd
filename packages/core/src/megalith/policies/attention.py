"""The attention forward of HF Llama / Qwen2 / Mistral with megalith's kernels, per module.

`attention_forward(fuse_qkv, rope)` builds an instance ``forward`` for one attention module; it
takes the same arguments and gives the same result as the family's own forward, KV-cache update
included (both spellings of the cache argument across transformers 5.x). Parameters are untouched:
names, sharding, optimizer state and checkpoints stay as they are. Because the swap is per module,
other models of the same family in the process keep HF's code.

* ``fuse_qkv``: q, k and v from one matmul over the concatenated weights. With grouped-query
  attention the key and value projections are narrow (TinyLlama-1.1B: 256 outputs against 2048
  for the query), and their backward matmuls (input gradient with an inner dimension of 256,
  weight gradients with 256 rows) keep a GPU's tensor cores poorly fed; one wide matmul makes one
  forward and two well-shaped backward products. The concatenation (and the split of its
  gradient) copies the ~10 MB of weights per layer, which costs far less. One TinyLlama layer on
  an H200 (16384 tokens, bf16, `benchmarks/gpu_qkv.py`): forward + backward of the three
  projections 0.88 ms separately, 0.77 ms fused (the forward alone is the same, 0.25 ms); the same
  fusion of the MLP's gate and up projections (5632 outputs each) gains nothing, so it is not done.
  Inside a whole ``torch.compile``-d training step the q/k/v gain did not show (76.7k vs 77.0k
  tokens/s, run-to-run noise), so the compiled benchmark leaves it out; eager steps use it.
  Only plain ``nn.Linear`` projections are fused (see `fusable_qkv`); others run as modules.
* ``rope``: the rotary kernel (`megalith.kernels.apply_rotary`) for the ``[batch, seq, dim]``
  cos/sin tables these models pass, the family's ``apply_rotary_pos_emb`` otherwise.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from megalith.kernels import apply_rotary


def fusable_qkv(module: nn.Module) -> bool:
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


def _projections(module: Any, x: torch.Tensor, fuse: bool) -> tuple[torch.Tensor, ...]:
    """q, k, v as ``[..., heads, seq, head_dim]``: one matmul when ``fuse``, the modules otherwise."""
    q, k, v = module.q_proj, module.k_proj, module.v_proj
    heads = (*x.shape[:-1], -1, module.head_dim)
    if fuse:
        weight = torch.cat((q.weight, k.weight, v.weight))
        bias = None if q.bias is None else torch.cat((q.bias, k.bias, v.bias))
        outs = F.linear(x, weight, bias).split([q.out_features, k.out_features, v.out_features], dim=-1)
    else:
        outs = (q(x), k(x), v(x))
    return tuple(t.view(heads).transpose(1, 2) for t in outs)


def attention_forward(fuse_qkv: bool, rope: bool) -> Any:
    """An attention ``forward`` (bind it to the module with ``types.MethodType``)."""

    def forward(
        self: Any,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, Any]:
        query, key, value = _projections(self, hidden_states, fuse_qkv)
        hf = sys.modules[type(self).__module__]  # the family's modeling module
        cos, sin = position_embeddings
        if rope and cos.dim() == 3:
            query, key = apply_rotary(query, key, cos, sin)
        else:
            query, key = hf.apply_rotary_pos_emb(query, key, cos, sin)
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
        return self.o_proj(out.reshape(*hidden_states.shape[:-1], -1).contiguous()), weights

    return forward
