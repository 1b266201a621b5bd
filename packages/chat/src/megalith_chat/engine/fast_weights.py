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
# name parts of PEFT adapter tensors (a PEFT state dict), which update_weights cannot take as they are
PEFT_MARKERS = (".lora_", ".base_layer.", ".lora_magnitude_vector", ".modules_to_save.", ".original_module.")


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
    window: int | None = None  # an active sliding-window attention's width (the engine needs max_len <= it)

    @classmethod
    def of(cls, model: nn.Module, max_len: int | None = None) -> ModelShape:
        """The shape of an HF decoder, refusing (:class:`ConfigError` naming the setting) what the
        engine's forward does not implement: MLP biases, an activation other than SiLU, RoPE whose
        tables change with the sequence length, and a sliding window narrower than the ``max_len``
        cache slots the engine may attend (``max_len=None``: any active window)."""
        cfg: Any = model.config
        if cfg.model_type not in SUPPORTED:
            raise ConfigError(f"the fast engine supports {SUPPORTED}, got model_type {cfg.model_type!r}")
        attn = model.model.layers[0].self_attn  # type: ignore[index,union-attr]
        mlp = model.model.layers[0].mlp  # type: ignore[index,union-attr]
        if getattr(mlp.gate_proj, "bias", None) is not None:
            raise ConfigError("MLP biases are not supported by the fast engine")
        _check_forward(cfg)
        heads = cfg.num_attention_heads
        shape = cls(
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
            window=sliding_window(cfg),
        )
        shape.check_len(max_len)
        return shape

    def check_len(self, max_len: int | None) -> None:
        """Refuse a cache of ``max_len`` slots wider than the sliding window (``None``: any window).

        HF's window ``W`` lets a query at slot ``i`` see slots ``j > i - W``; the engine's dense
        cache lets it see ``j >= i - (max_len - 1)``, the same set only while ``max_len <= W``."""
        if self.window is not None and (max_len is None or max_len > self.window):
            raise ConfigError(
                f"sliding-window attention (sliding_window={self.window}) is not supported by the fast "
                f"engine beyond the window: need max_len <= {self.window}, got {max_len}"
            )


ACTIVATIONS = ("silu", "swish")  # the engine's MLP is SwiGLU: silu(gate) * up
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")  # HF recomputes their tables for longer sequences


def rope_types(cfg: Any) -> set[str]:
    """The ``rope_type`` s of ``cfg.rope_parameters`` (transformers 5) or ``cfg.rope_scaling``
    (older), including per-layer-type parameter dicts; ``default`` when unset."""
    found: set[str] = set()
    for attr in ("rope_parameters", "rope_scaling"):
        params = getattr(cfg, attr, None)
        if not isinstance(params, Mapping):
            continue
        groups = [p for p in params.values() if isinstance(p, Mapping)] or [params]
        found.update(str(p.get("rope_type", p.get("type", "default"))) for p in groups)
    return found or {"default"}


def sliding_window(cfg: Any) -> int | None:
    """The width of the sliding-window attention some layer of ``cfg`` uses, or None.

    Mistral applies ``sliding_window`` to every layer when set; Qwen2 only with
    ``use_sliding_window`` and to the layers ``layer_types`` marks ``sliding_attention``."""
    window = getattr(cfg, "sliding_window", None)
    if window is None or getattr(cfg, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(cfg, "layer_types", None)
    if cfg.model_type != "mistral" and layer_types is not None and "sliding_attention" not in layer_types:
        return None
    return int(window)


def _check_forward(cfg: Any) -> None:
    """Refuse an activation or a RoPE type the engine's forward does not implement."""
    act = getattr(cfg, "hidden_act", "silu")
    if act not in ACTIVATIONS:
        raise ConfigError(
            f"hidden_act={act!r} is not supported by the fast engine (its MLP is SwiGLU: {ACTIVATIONS})"
        )
    bad = sorted(rope_types(cfg) & set(LENGTH_DEPENDENT_ROPE))
    if bad:
        raise ConfigError(
            f"rope_type={bad[0]!r} is not supported by the fast engine: its cos/sin tables depend on the "
            f"sequence length ({LENGTH_DEPENDENT_ROPE} are refused)"
        )


def _linear(module: Any) -> Any:
    """The plain ``nn.Linear`` of a (possibly LoRA-wrapped) projection."""
    return getattr(module, "base_layer", module)


def unwrap_peft(model: Any) -> Any:
    """The underlying HF model of a PEFT model (the model itself otherwise)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def effective_weights(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(HF name, tensor)`` of every parameter as the (PEFT) model's forward applies it.

    LoRA adapters are merged (``W + (alpha/r) B A`` through PEFT's ``get_delta_weight``; DoRA as
    :func:`_merged_lora` says), and of a ``modules_to_save`` wrapper only the module the forward
    runs (the active adapter's copy, else the original) is yielded, under the plain name.
    """
    base = unwrap_peft(model)
    merged: dict[str, torch.Tensor] = {}
    chosen: dict[str, str] = {}  # modules_to_save wrapper name -> the prefix of the module it runs
    for name, module in base.named_modules():
        if hasattr(module, "base_layer") and hasattr(module, "get_delta_weight"):
            weight, bias = _merged_lora(name, module)
            merged[f"{name}.weight"] = weight
            if bias is not None:
                merged[f"{name}.bias"] = bias
        elif hasattr(module, "original_module") and hasattr(module, "modules_to_save"):
            chosen[name] = _saved_module(module)
    for name, param in base.named_parameters():
        clean = _plain_name(name, chosen)
        if clean is None:
            continue
        yield clean, merged.get(clean, param.detach())


def _plain_name(name: str, chosen: Mapping[str, str]) -> str | None:
    """The HF name of a PEFT parameter, or None for adapter weights and the modules a
    ``modules_to_save`` wrapper does not run."""
    if "lora_" in name:
        return None
    for wrapper, prefix in chosen.items():
        if name.startswith(f"{wrapper}."):
            inner = f"{wrapper}.{prefix}."
            return f"{wrapper}.{name[len(inner) :]}" if name.startswith(inner) else None
    return name.replace(".base_layer.", ".")


def _saved_module(wrapper: Any) -> str:
    """Which module a PEFT ``ModulesToSaveWrapper`` runs: ``modules_to_save.<adapter>`` for the first
    active adapter that has one (as its forward does), else ``original_module``."""
    active = list(getattr(wrapper, "active_adapters", ()))
    if not getattr(wrapper, "disable_adapters", False) and active and active[0] in wrapper.modules_to_save:
        return f"modules_to_save.{active[0]}"
    return "original_module"


def _merged_lora(name: str, module: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Weight and bias of a PEFT LoRA layer with its active adapters merged (the bias only when an
    adapter has ``lora_bias``; else None: the base layer's own bias is yielded unchanged).

    Plain LoRA adds ``ΔW = get_delta_weight(a)`` (and ``scaling · b_B`` to the bias). DoRA (Liu et
    al. 2024) rescales each output row: PEFT's forward computes ``f = m / ||W + ΔW||_row`` from the
    *base* weight ``W`` and the magnitude vector ``m``, and turns the running output ``R x + e`` into
    ``f ⊙ (R x + e + ΔW x + scaling · b_B)``; so ``R ← f ⊙ (R + ΔW)`` and ``e ← f ⊙ (e + scaling · b_B)``.
    Other LoRA variants, and DoRA on anything but an ``nn.Linear``, raise :class:`ConfigError`.
    """
    layer = module.get_base_layer()
    base = layer.weight.detach()
    if getattr(module, "merged", False) or getattr(module, "disable_adapters", False):
        return base, None
    weight, extra, biased = base, torch.zeros(base.shape[0], dtype=base.dtype, device=base.device), False
    for adapter in module.active_adapters:
        if adapter not in module.lora_A and adapter not in getattr(module, "lora_embedding_A", {}):
            continue
        delta = module.get_delta_weight(adapter).to(base.dtype)
        b = _lora_bias(module, adapter)
        biased = biased or b is not None
        b = extra.new_zeros(()) if b is None else b.to(base.dtype)
        if _is_dora(name, module, adapter):
            dora = module.lora_magnitude_vector[adapter]
            norm = dora.get_weight_norm(base, delta, scaling=1).detach()
            scale = (dora.weight.detach() / norm).to(base.dtype)  # [out]
            weight, extra = scale.unsqueeze(1) * (weight + delta), scale * (extra + b)
        else:
            weight, extra = weight + delta, extra + b
    bias = getattr(layer, "bias", None)
    if not biased:
        return weight, None
    if bias is None:
        raise ConfigError(
            f"lora_bias on {name}, whose base layer has no bias: the fast engine has no slot for it"
        )
    return weight, bias.detach() + extra


def _lora_bias(module: Any, adapter: str) -> torch.Tensor | None:
    """``scaling · b_B`` of an adapter trained with ``lora_bias=True`` (None otherwise)."""
    if not getattr(module, "lora_bias", {}).get(adapter, False):
        return None
    return module.lora_B[adapter].bias.detach() * module.scaling[adapter]


def _is_dora(name: str, module: Any, adapter: str) -> bool:
    """Whether ``adapter`` of ``module`` is DoRA; refuses LoRA variants the merge does not implement."""
    variant = getattr(module, "lora_variant", {}).get(adapter)
    kind = type(variant).__name__ if variant is not None else None
    dora = adapter in getattr(module, "lora_magnitude_vector", {})
    linear = isinstance(module.get_base_layer(), nn.Linear) and not getattr(module, "fan_in_fan_out", False)
    if kind not in (None, "DoraLinearVariant") or (dora and not linear):
        raise ConfigError(
            f"the fast engine cannot merge the LoRA variant {kind or 'DoRA'} of adapter {adapter!r} "
            f"on {name} ({type(module.get_base_layer()).__name__}); plain LoRA and DoRA on nn.Linear are supported"
        )
    return dora


class EngineWeights:
    """Fused per-layer weights on ``device`` in ``dtype`` plus the name -> view table."""

    def __init__(self, shape: ModelShape, device: torch.device, dtype: torch.dtype) -> None:
        s = shape
        qkv = (s.heads + 2 * s.kv_heads) * s.head_dim

        def empty(*size: int) -> torch.Tensor:
            return torch.empty(*size, device=device, dtype=dtype)

        def zeros(*size: int) -> torch.Tensor:
            return torch.zeros(*size, device=device, dtype=dtype)

        self.shape = s
        self.embed = empty(s.vocab, s.hidden)
        self.norm = empty(s.hidden)
        self.lm_head = self.embed if s.tied else empty(s.vocab, s.hidden)
        self.ln1 = [empty(s.hidden) for _ in range(s.layers)]
        self.ln2 = [empty(s.hidden) for _ in range(s.layers)]
        self.wqkv = [empty(qkv, s.hidden) for _ in range(s.layers)]
        self.bqkv = [zeros(qkv) if s.qkv_bias else None for _ in range(s.layers)]
        self.wo = [empty(s.hidden, s.heads * s.head_dim) for _ in range(s.layers)]
        self.bo = [zeros(s.hidden) if s.o_bias else None for _ in range(s.layers)]
        self.wgu = [empty(2 * s.intermediate, s.hidden) for _ in range(s.layers)]
        self.wd = [empty(s.hidden, s.intermediate) for _ in range(s.layers)]
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

    def _check_tied(self, given: Mapping[str, torch.Tensor]) -> None:
        """A tied LM head shares the embedding's storage: refuse two different tensors for it (e.g. a
        PEFT ``modules_to_save`` copy of one of them)."""
        head, embed = given.get("lm_head.weight"), given.get("model.embed_tokens.weight")
        if self.shape.tied and head is not None and embed is not None and not torch.equal(head, embed):
            raise ConfigError(
                "the model ties lm_head.weight to model.embed_tokens.weight (tie_word_embeddings) but "
                "they differ; the fast engine keeps one tensor for both"
            )

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
            if dest is None and any(part in name for part in PEFT_MARKERS):
                raise ConfigError(
                    f"{name!r} is a PEFT adapter tensor: pass the PEFT model itself "
                    "(update_weights(model)), which merges its adapters as PEFT applies them"
                )
            if dest is None:
                raise ConfigError(f"the fast engine has no parameter {name!r}")
            if tuple(dest.shape) != tuple(tensor.shape):
                raise ConfigError(
                    f"parameter {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}"
                )
            given[key] = tensor.detach()
        self._check_tied(given)
        folded: dict[str, str] = {}  # projection name -> its norm weight name
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
                weight = self.views[folded[key]]
                self.views[key].copy_(tensor.to(weight.device, torch.float32) * weight.float())
        return len(given)
