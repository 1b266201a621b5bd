"""Split a model into pipeline stages, applied from outside the model.

Two model shapes are understood:

* HF decoders (Llama, Qwen2, Mistral in transformers 5): `model.model.embed_tokens`,
  `model.model.layers`, `model.model.norm`, `model.model.rotary_emb`, `model.lm_head`. Stage 0 holds
  the embedding, the last stage the final norm and the LM head; the decoder layers are divided
  between the S = p·v stages. Every stage computes its own position ids, rotary embeddings and
  causal mask from the microbatch (nothing but hidden states `[b, s, h]` is sent) and calls each
  decoder layer with transformers 5's signature
  `layer(h, attention_mask=..., position_embeddings=(cos, sin), position_ids=...)`.
* `nn.Sequential` (or any module whose children are applied in order): the children are the layers;
  stage 0 receives the microbatch's input tensor.

Pruning replaces every module a rank does not hold with an empty `_Dropped` placeholder, so its
parameters are freed while the kept parameters keep their full-model names (checkpoints written by
any pipeline layout use the names of the whole model).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from megalith.common.errors import ConfigError, DistributedError

Microbatch = Mapping[str, Any] | torch.Tensor


class _Dropped(nn.Module):
    """Placeholder for a module held by another pipeline rank (it has no parameters)."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise DistributedError("this module lives on another pipeline rank; use booster.execute_pipeline")


class Stage(Protocol):
    """One pipeline stage: `forward(x, mb)` maps the previous stage's output (None on stage 0) and
    the microbatch to this stage's output (the model output on the last stage)."""

    index: int
    is_last: bool

    def forward(self, x: torch.Tensor | None, mb: Microbatch) -> torch.Tensor: ...

    def parameters(self) -> list[nn.Parameter]: ...


def balance_layers(costs: Sequence[int], num_stages: int) -> list[int]:
    """Layers per stage: a contiguous partition of `costs` (parameters per layer) into `num_stages`
    non-empty parts that minimises the largest part (dynamic programming, O(n²·S))."""
    n = len(costs)
    if n < num_stages:
        raise ConfigError(f"{n} layers cannot fill {num_stages} pipeline stages (pp_size × num_model_chunks)")
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]  # best[k][i]: first i layers in k stages
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0
    for k in range(1, num_stages + 1):
        for i in range(k, n - (num_stages - k) + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    sizes, i = [], n
    for k in range(num_stages, 0, -1):
        sizes.append(i - cut[k][i])
        i = cut[k][i]
    return sizes[::-1]


def stage_ranges(
    costs: Sequence[int], num_stages: int, layers_per_stage: Sequence[int] | None = None
) -> list[range]:
    """Layer index ranges per stage, balanced by parameter count or as given explicitly."""
    n = len(costs)
    if layers_per_stage is None:
        sizes = balance_layers(costs, num_stages)
    else:
        sizes = list(layers_per_stage)
        if len(sizes) != num_stages or sum(sizes) != n or min(sizes, default=0) < 1:
            raise ConfigError(
                f"layers_per_stage={sizes} must give each of the {num_stages} stages at least one layer "
                f"and sum to the model's {n} layers"
            )
    out, start = [], 0
    for size in sizes:
        out.append(range(start, start + size))
        start += size
    return out


def _hf(model: nn.Module) -> Any:
    """The model seen untyped (HF attribute access: `.model.layers`, `.lm_head`...)."""
    return model


def is_hf_decoder(model: nn.Module) -> bool:
    inner = getattr(model, "model", None)
    return all(hasattr(inner, a) for a in ("embed_tokens", "layers", "norm")) and hasattr(model, "lm_head")


def layer_list(model: nn.Module) -> list[nn.Module]:
    """The layers a model is split into: HF decoder layers, or the children of a sequential model."""
    if is_hf_decoder(model):
        return list(_hf(model).model.layers)
    children = list(model.children())
    if not children:
        raise ConfigError(f"{type(model).__name__} has no layers to split into pipeline stages")
    return children


def _params_of(modules: Sequence[nn.Module]) -> list[nn.Parameter]:
    seen: dict[int, nn.Parameter] = {}
    for m in modules:
        for p in m.parameters():
            if p.requires_grad:
                seen.setdefault(id(p), p)
    return list(seen.values())


def _run_layers(
    layers: Sequence[Callable[[torch.Tensor], torch.Tensor]], x: torch.Tensor, checkpointed: int
) -> torch.Tensor:
    """Apply the layers in order; the first `checkpointed` recompute their activations in backward."""
    for i, layer in enumerate(layers):
        if i < checkpointed and torch.is_grad_enabled():
            x = checkpoint(layer, x, use_reentrant=False)
        else:
            x = layer(x)
    return x


def _attention_kinds(config: Any, n: int) -> list[str]:
    """Mask kind per decoder layer, as the HF model picks it: `config.layer_types` (Qwen2, Gemma…),
    else one kind for all layers — sliding-window when `config.sliding_window` is set (Mistral)."""
    kinds = getattr(config, "layer_types", None)
    if kinds:
        return list(kinds)
    return ["sliding_attention" if getattr(config, "sliding_window", None) else "full_attention"] * n


class DecoderStage:
    """Stage `index` of an HF decoder: [embed] → layers[start:stop] → [norm → lm_head].

    Input `[b, s, h]` hidden states (None on stage 0, which embeds `mb["input_ids"]`); position ids
    `mb["position_ids"]` `[b, s]` when the microbatch has them, else 0..s−1; output
    `[b, s, h]`, or the logits `[b, s, V]` (a vocabulary block under tensor parallelism) on the last."""

    def __init__(self, model: nn.Module, index: int, layers: range, is_last: bool, checkpointed: int) -> None:
        self.model, self.index, self.layers, self.is_last = model, index, layers, is_last
        self.checkpointed = checkpointed
        inner = _hf(model).model
        held: list[nn.Module] = [inner.layers[i] for i in layers]
        held += [inner.embed_tokens] if index == 0 else []
        held += [inner.norm, _hf(model).lm_head] if is_last else []
        self._modules = held
        module = sys.modules[type(inner).__module__]
        self._mask_fns = {
            "full_attention": getattr(module, "create_causal_mask", None),
            "sliding_attention": getattr(module, "create_sliding_window_causal_mask", None),
        }
        if self._mask_fns["full_attention"] is None:
            raise ConfigError(
                f"{type(inner).__name__}'s module has no create_causal_mask (not a transformers 5 decoder)"
            )

    def parameters(self) -> list[nn.Parameter]:
        return _params_of(self._modules)

    def _masks(self, dummy: torch.Tensor, mb: Mapping[str, Any], pos: torch.Tensor) -> dict[str, Any]:
        config = _hf(self.model).model.config
        types = _attention_kinds(config, len(_hf(self.model).model.layers))
        out: dict[str, Any] = {}
        for i in self.layers:
            kind = types[i]
            if kind not in out:
                fn = self._mask_fns.get(kind)
                if fn is None:
                    raise ConfigError(f"layer {i} has attention type {kind!r}, which has no mask function")
                out[kind] = fn(config, dummy, mb.get("attention_mask"), None, pos)
        return out

    def forward(self, x: torch.Tensor | None, mb: Microbatch) -> torch.Tensor:
        if not isinstance(mb, Mapping):
            mb = {"input_ids": mb}
        inner = _hf(self.model).model
        ids = mb["input_ids"]
        if x is None:
            x = inner.embed_tokens(ids)
        assert x is not None
        b, s = ids.shape
        pos = mb.get("position_ids")  # as HF: given (e.g. left-padded prompts) or 0..s-1
        if pos is None:
            pos = torch.arange(s, device=x.device).unsqueeze(0)
        # Under sequence parallelism x may be a sequence shard: mask and rotary need the full length.
        dummy = x.new_zeros(()).expand(b, s, x.shape[-1])
        cos_sin = inner.rotary_emb(dummy, pos)
        masks = self._masks(dummy, mb, pos)
        types = _attention_kinds(inner.config, len(inner.layers))
        calls = [
            functools.partial(
                inner.layers[i],
                attention_mask=masks[types[i]],
                position_embeddings=cos_sin,
                position_ids=pos,
            )
            for i in self.layers
        ]
        x = _run_layers(calls, x, self.checkpointed)
        if self.is_last:
            x = _hf(self.model).lm_head(inner.norm(x))
        return x


class SequentialStage:
    """Stage `index` of a sequential model: children[start:stop] applied in order. Stage 0 reads
    `mb["input"]` (or the microbatch itself when it is a tensor)."""

    def __init__(self, model: nn.Module, index: int, layers: range, is_last: bool, checkpointed: int) -> None:
        children = list(model.children())
        self.index, self.layers, self.is_last, self.checkpointed = index, layers, is_last, checkpointed
        self._modules = [children[i] for i in layers]

    def parameters(self) -> list[nn.Parameter]:
        return _params_of(self._modules)

    def forward(self, x: torch.Tensor | None, mb: Microbatch) -> torch.Tensor:
        if x is None:
            x = mb if isinstance(mb, torch.Tensor) else mb["input"]
        return _run_layers(self._modules, x, self.checkpointed)


def make_stages(
    model: nn.Module, ranges: Sequence[range], held: Sequence[int], checkpoint_ratio: float = 0.0
) -> dict[int, Stage]:
    """Stage objects for the stages `held` by this rank (`ranges[s]`: the layers of stage s).
    `checkpoint_ratio` of each stage's layers (rounded) recompute activations in backward."""
    if not 0.0 <= checkpoint_ratio <= 1.0:
        raise ConfigError(f"checkpoint_ratio must be in [0, 1], got {checkpoint_ratio}")
    kind = DecoderStage if is_hf_decoder(model) else SequentialStage
    last = len(ranges) - 1
    return {s: kind(model, s, ranges[s], s == last, round(checkpoint_ratio * len(ranges[s]))) for s in held}


def prune(model: nn.Module, ranges: Sequence[range], held: Sequence[int]) -> None:
    """Replace every layer (and embedding / norm / head) this rank does not hold with `_Dropped`."""
    keep = {i for s in held for i in ranges[s]}
    first, last = 0 in held, len(ranges) - 1 in held
    if is_hf_decoder(model):
        hf = _hf(model)
        inner = hf.model
        for i in range(len(inner.layers)):
            if i not in keep:
                inner.layers[i] = _Dropped()
        if not first:
            inner.embed_tokens = _Dropped()
        if not last:
            inner.norm = _Dropped()
            hf.lm_head = _Dropped()
        return
    for i, (name, _) in enumerate(list(model.named_children())):
        if i not in keep:
            setattr(model, name, _Dropped())


def layer_costs(model: nn.Module) -> list[int]:
    """Parameters per layer (the balancing weight)."""
    return [sum(p.numel() for p in layer.parameters()) for layer in layer_list(model)]
