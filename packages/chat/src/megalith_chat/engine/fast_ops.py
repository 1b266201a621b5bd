"""The decoder math of the fast rollout engine as small pure functions (compilable one by one).

Shapes: ``b`` rows, ``H`` query heads and ``KV`` key/value heads of size ``D`` (``G = H / KV``
query heads share one key/value head, GQA), ``hidden`` model width, ``I`` MLP width.
The functions reproduce Hugging Face's Llama/Qwen2/Mistral modules:

* RMSNorm (Zhang & Sennrich 2019): ``w * (x / sqrt(mean(x^2) + eps))`` computed in float32 and
  cast back before the weight multiply, as HF does; inside the layers ``w`` is folded into the next
  projection (:mod:`.fast_weights`) and ``1 / rms(x)`` applied to its output (:func:`norm_linear`,
  :func:`norm_silu_mul`);
* rotary embedding (Su et al. 2021, "rotate half" layout): ``x cos + rotate_half(x) sin`` with
  ``cos``/``sin`` taken from the model's own ``rotary_emb`` (so RoPE scaling variants carry over);
* SwiGLU MLP (Shazeer 2020): ``W_down (silu(W_gate x) * W_up x)``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``[..., hidden]`` -> ``[..., hidden]``."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rms_scale(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``1 / sqrt(mean(x^2) + eps)`` per row, float32 ``[..., 1]``."""
    return torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)


def norm_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``linear(rms_norm(x, w), W, b)`` with ``weight = W diag(w)`` (the norm weight folded in, see
    :mod:`.fast_weights`): ``(x W'^T) / rms(x) + b``."""
    out = (F.linear(x, weight).float() * rms_scale(x, eps)).to(x.dtype)
    return out if bias is None else out + bias


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x cos + rotate_half(x) sin`` with ``rotate_half([a, b]) = [-b, a]`` over the last dim."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def split_rope_decode(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One decode token per row: ``qkv [b, (H + 2KV) D]``, ``cos/sin [b, D]``.

    Returns ``q [b, KV, G, D]`` (the ``G`` query heads of a key/value head act as ``G`` query
    positions, so SDPA needs no key/value repeat) and ``k, v [b, KV, 1, D]``.
    """
    b = qkv.shape[0]
    kvd = kv_heads * head_dim
    q, k, v = qkv.split([qkv.shape[1] - 2 * kvd, kvd, kvd], dim=-1)
    q = rotate(q.view(b, kv_heads, -1, head_dim), cos[:, None, None], sin[:, None, None])
    k = rotate(k.view(b, kv_heads, 1, head_dim), cos[:, None, None], sin[:, None, None])
    return q.contiguous(), k.contiguous(), v.reshape(b, kv_heads, 1, head_dim).contiguous()


def norm_silu_mul(gate_up: torch.Tensor, x: torch.Tensor, eps: float) -> torch.Tensor:
    """SwiGLU of ``gate_up = x W_gu'^T`` (``[..., 2I]``, the norm weight folded into ``W_gu'``):
    ``silu(gate / rms(x)) * up / rms(x)`` of shape ``[..., I]``."""
    scale = rms_scale(x, eps)
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (F.silu(gate * scale) * (up * scale)).to(gate_up.dtype)


def decode_prelude(
    tokens: torch.Tensor,
    slot: torch.Tensor,
    start: torch.Tensor,
    embed: torch.Tensor,
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
    arange: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Embedding, rotary tables and attention mask of one decode step.

    ``tokens [b]`` sit at cache slot ``slot`` (0-d); row ``r``'s prompt starts at ``start[r]``
    (left padding), so its position is ``slot - start[r]`` and it may attend to cache slots
    ``start[r] <= j <= slot`` of ``arange [Lb]``. Returns ``x [b, hidden]``, ``cos, sin [b, D]``
    and the bool mask ``[b, 1, 1, Lb]``.
    """
    pos = slot - start
    valid = (arange.unsqueeze(0) >= start.unsqueeze(1)) & (arange.unsqueeze(0) <= slot)
    return embed[tokens], cos_table[pos], sin_table[pos], valid[:, None, None, :]


@dataclass(frozen=True)
class Ops:
    """The per-step functions, eager or each wrapped by ``torch.compile`` (fused elementwise)."""

    rms_norm: Callable[..., torch.Tensor]
    norm_linear: Callable[..., torch.Tensor]
    split_rope_decode: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    norm_silu_mul: Callable[..., torch.Tensor]
    decode_prelude: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]
    sample: Callable[..., tuple[torch.Tensor, torch.Tensor]]

    @classmethod
    def make(cls, compiled: bool) -> Ops:
        from megalith_chat.engine.sampling import sample_tokens

        fns = (rms_norm, norm_linear, split_rope_decode, norm_silu_mul, decode_prelude, sample_tokens)
        if compiled:
            fns = tuple(torch.compile(f, dynamic=True) for f in fns)  # type: ignore[assignment]
        return cls(*fns)
