"""Causal SDPA without a materialised mask while ``torch.compile`` traces an HF model.

Hugging Face decides per call whether a causal mask can be left to SDPA's ``is_causal=True``, the
path on which the flash and cuDNN kernels skip the masked upper triangle. With the transformers
and torch versions this stack supports (torch < 2.14), it never skips while dynamo traces: every
compiled forward builds a ``[b, 1, s, s]`` boolean mask and SDPA runs the masked kernels over the
whole square (on an H200, the TinyLlama-shape attention backward took 2.5x longer per layer).

`use_mask_free_causal_sdpa(model)` switches a model whose attention implementation is ``"sdpa"`` to
``"megalith_sdpa"``: the same attention function, with a mask function that returns ``None`` (=
``is_causal=True``) exactly when the mask would be plain causal over the whole key range (no
padding mask, no sliding window or packed-sequence pattern, as many keys as queries), decided from
Python values only, so tracing reads no tensor. Every other call builds HF's own SDPA mask.
"""

from __future__ import annotations

from typing import Any

from torch import nn

NAME = "megalith_sdpa"


def _plain_causal(kwargs: dict[str, Any]) -> bool:
    """Whether HF's arguments describe a causal mask over as many keys as queries, nothing else."""
    from transformers.masking_utils import causal_mask_function

    if kwargs.get("attention_mask") is not None or not kwargs.get("allow_is_causal_skip", True):
        return False
    if kwargs.get("local_size") is not None:
        return False
    if kwargs.get("mask_function", causal_mask_function) is not causal_mask_function:
        return False
    q_length, kv_length = kwargs.get("q_length"), kwargs.get("kv_length")
    return q_length is not None and kv_length is not None and q_length == kv_length


def _mask(*args: Any, **kwargs: Any) -> Any:
    from transformers.masking_utils import sdpa_mask

    if not args and _plain_causal(kwargs):
        return None
    return sdpa_mask(*args, **kwargs)


def _register() -> None:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(NAME, sdpa_attention_forward)
    AttentionMaskInterface.register(NAME, _mask)


def use_mask_free_causal_sdpa(model: nn.Module) -> bool:
    """Switch `model` from ``"sdpa"`` to ``"megalith_sdpa"`` (see module doc); False if it uses another
    attention implementation (left unchanged)."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    _register()
    config._attn_implementation = NAME
    return True


def restore_sdpa(model: nn.Module) -> None:
    """Undo `use_mask_free_causal_sdpa` (no-op if it was not applied)."""
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "_attn_implementation", None) == NAME:
        config._attn_implementation = "sdpa"
