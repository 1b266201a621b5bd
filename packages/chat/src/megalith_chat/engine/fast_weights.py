"""Weight storage of the fast rollout engine, filled from (and updated in place by) HF parameters.

The engine keeps its own copies of a Llama / Qwen2 / Mistral decoder's weights, fused where that
saves kernels: per layer ``wqkv = [W_q; W_k; W_v]`` (``[(H + 2 KV) * D, hidden]``) and
``wgu = [W_gate; W_up]`` (``[2 I, hidden]``). Every HF parameter name maps to a *view* of this
storage, so :meth:`EngineWeights.load` copies into the existing tensors: pointers never change and
captured CUDA graphs stay valid after a weight update.

**Norm weights are folded into the projections they feed.** ``W (w * x / rms(x)) = (W diag(w)) x /
rms(x)``, so ``wqkv`` holds ``W_qkv diag(w_input_layernorm)`` and ``wgu`` holds ``W_gu
diag(w_post_attention_layernorm)`` (the product rounded once to the storage dtype). The engine then
projects the un-normalised residual stream and applies the per-row ``1 / rms(x)`` in the kernel that
consumes the projection, which removes both norm kernels of every layer from the decode step. The
final norm is not folded (the LM head may be tied to the embedding). A norm weight can therefore only
be updated together with the projections it folds into; a projection alone is folded with the
current norm weight.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from megalith.common.errors import ConfigError

SUPPORTED = ("llama", "qwen2", "mistral")
_LAYER = re.compile(r"layers\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class ModelShape:
    """The decoder's sizes: ``L`` layers, ``H`` query heads, ``KV`` key/value heads of size ``D``."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    eps: float
    qkv_bias: bool
    o_bias: bool
    tied: bool

    @classmethod
    def of(cls, model: nn.Module) -> ModelShape:
        cfg: Any = model.config
        if cfg.model_type not in SUPPORTED:
            raise ConfigError(f"the fast engine supports {SUPPORTED}, got model_type {cfg.model_type!r}")
        attn = model.model.layers[0].self_attn  # type: ignore[index,union-attr]
        mlp = model.model.layers[0].mlp  # type: ignore[index,union-attr]
        if getattr(mlp.gate_proj, "bias", None) is not None:
            raise ConfigError("MLP biases are not supported by the fast engine")
        heads = cfg.num_attention_heads
        return cls(
            layers=cfg.num_hidden_layers,
            hidden=cfg.hidden_size,
            heads=heads,
            kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
            intermediate=cfg.intermediate_size,
            vocab=cfg.vocab_size,
            eps=float(cfg.rms_norm_eps),
            qkv_bias=_linear(attn.q_proj).bias is not None,
            o_bias=_linear(attn.o_proj).bias is not None,
            tied=bool(getattr(cfg, "tie_word_embeddings", False)),
        )


def _linear(module: Any) -> Any:
    """The plain ``nn.Linear`` of a (possibly LoRA-wrapped) projection."""
    return getattr(module, "base_layer", module)


def unwrap_peft(model: Any) -> Any:
    """The underlying HF model of a PEFT model (the model itself otherwise)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def effective_weights(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(HF name, tensor)`` of every parameter, LoRA adapters merged: ``W + (alpha/r) B A``."""
    base = unwrap_peft(model)
    merged: dict[str, torch.Tensor] = {}
    for name, module in base.named_modules():
        if hasattr(module, "base_layer") and hasattr(module, "get_delta_weight"):
            weight = module.base_layer.weight.detach()
            if not getattr(module, "merged", False) and not getattr(module, "disable_adapters", False):
                for adapter in module.active_adapters:
                    if adapter in module.lora_A:
                        weight = weight + module.get_delta_weight(adapter).to(weight.dtype)
            merged[f"{name}.weight"] = weight
    for name, param in base.named_parameters():
        if "lora_" in name:
            continue
        clean = name.replace(".base_layer.", ".")
        yield clean, merged.get(clean, param.detach())


class EngineWeights:
    """Fused per-layer weights on ``device`` in ``dtype`` plus the name -> view table."""

    def __init__(self, shape: ModelShape, device: torch.device, dtype: torch.dtype) -> None:
        s, kw = shape, {"device": device, "dtype": dtype}
        qkv = (s.heads + 2 * s.kv_heads) * s.head_dim
        self.shape = s
        self.embed = torch.empty(s.vocab, s.hidden, **kw)  # type: ignore[arg-type]
        self.norm = torch.empty(s.hidden, **kw)  # type: ignore[arg-type]
        self.lm_head = self.embed if s.tied else torch.empty(s.vocab, s.hidden, **kw)  # type: ignore[arg-type]
        self.ln1 = [torch.empty(s.hidden, **kw) for _ in range(s.layers)]  # type: ignore[arg-type]
        self.ln2 = [torch.empty(s.hidden, **kw) for _ in range(s.layers)]  # type: ignore[arg-type]
        self.wqkv = [torch.empty(qkv, s.hidden, **kw) for _ in range(s.layers)]  # type: ignore[arg-type]
        self.bqkv = [torch.zeros(qkv, **kw) if s.qkv_bias else None for _ in range(s.layers)]  # type: ignore[arg-type]
        self.wo = [torch.empty(s.hidden, s.heads * s.head_dim, **kw) for _ in range(s.layers)]  # type: ignore[arg-type]
        self.bo = [torch.zeros(s.hidden, **kw) if s.o_bias else None for _ in range(s.layers)]  # type: ignore[arg-type]
        self.wgu = [torch.empty(2 * s.intermediate, s.hidden, **kw) for _ in range(s.layers)]  # type: ignore[arg-type]
        self.wd = [torch.empty(s.hidden, s.intermediate, **kw) for _ in range(s.layers)]  # type: ignore[arg-type]
        self.views = self._views()

    def _views(self) -> dict[str, torch.Tensor]:
        """HF name (``model.layers.3.self_attn.q_proj.weight`` ...) -> destination view."""
        s = self.shape
        q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
        views = {
            "model.embed_tokens.weight": self.embed,
            "model.norm.weight": self.norm,
            "lm_head.weight": self.lm_head,
        }
        for i in range(s.layers):
            p = f"model.layers.{i}."
            views[p + "input_layernorm.weight"] = self.ln1[i]
            views[p + "post_attention_layernorm.weight"] = self.ln2[i]
            for part, lo, hi in (("q", 0, q), ("k", q, q + kv), ("v", q + kv, q + 2 * kv)):
                views[p + f"self_attn.{part}_proj.weight"] = self.wqkv[i][lo:hi]
                bias = self.bqkv[i]
                if bias is not None:
                    views[p + f"self_attn.{part}_proj.bias"] = bias[lo:hi]
            views[p + "self_attn.o_proj.weight"] = self.wo[i]
            bo = self.bo[i]
            if bo is not None:
                views[p + "self_attn.o_proj.bias"] = bo
            views[p + "mlp.gate_proj.weight"] = self.wgu[i][: s.intermediate]
            views[p + "mlp.up_proj.weight"] = self.wgu[i][s.intermediate :]
            views[p + "mlp.down_proj.weight"] = self.wd[i]
        return views

    @staticmethod
    def canonical(name: str) -> str:
        """Strip PEFT prefixes so ``base_model.model.model.layers.0...`` reads ``model.layers.0...``."""
        name = name.replace(".base_layer.", ".")
        for prefix in ("base_model.model.", "module."):
            if name.startswith(prefix):
                name = name[len(prefix) :]
        m = _LAYER.search(name)
        if m is not None and not name.startswith("model."):
            name = f"model.layers.{m.group(1)}.{m.group(2)}"
        return name

    def folds(self) -> dict[str, tuple[str, ...]]:
        """Norm weight name -> the projection weight names it is folded into."""
        out = {}
        for i in range(self.shape.layers):
            p = f"model.layers.{i}."
            out[p + "input_layernorm.weight"] = tuple(p + f"self_attn.{n}_proj.weight" for n in "qkv")
            out[p + "post_attention_layernorm.weight"] = (
                p + "mlp.gate_proj.weight",
                p + "mlp.up_proj.weight",
            )
        return out

    @torch.no_grad()
    def load(self, named: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy HF-named tensors into the existing storage (in place), folding norm weights into their
        projections; returns how many were copied.

        Everything is checked before anything is written: an unknown name, a wrong shape, or a norm
        weight without all of its projections raises :class:`ConfigError` naming the parameter.
        """
        items = named.items() if isinstance(named, Mapping) else named
        given: dict[str, torch.Tensor] = {}
        for name, tensor in items:
            key = self.canonical(name)
            dest = self.views.get(key)
            if dest is None:
                raise ConfigError(f"the fast engine has no parameter {name!r}")
            if tuple(dest.shape) != tuple(tensor.shape):
                raise ConfigError(
                    f"parameter {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}"
                )
            given[key] = tensor.detach()
        folded = {}  # projection name -> its norm weight name
        for norm, projections in self.folds().items():
            missing = [p for p in projections if p not in given]
            if norm in given and missing:
                raise ConfigError(f"{norm} is folded into {', '.join(missing)}: update it together with them")
            folded.update((p, norm) for p in projections)
        for key, tensor in given.items():
            if key not in folded:
                self.views[key].copy_(tensor, non_blocking=True)
        for key, tensor in given.items():
            if key in folded:
                norm = self.views[folded[key]]
                self.views[key].copy_(tensor.to(norm.device, torch.float32) * norm.float())
        return len(given)
