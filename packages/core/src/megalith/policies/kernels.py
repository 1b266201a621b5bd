"""Kernel policy: swap megalith's fused kernels into HF Llama / Qwen2 / Mistral models from outside.

What `apply_kernels(model)` patches (all undone by `remove_kernels(model)`):

- every ``{Llama,Qwen2,Mistral}RMSNorm`` module → a `KernelRMSNorm` holding the *same* weight
  Parameter (names, optimizer state and checkpoints unchanged);
- every ``{Llama,Qwen2,Mistral}MLP`` without biases and with SiLU → its instance ``forward`` becomes
  `swiglu_mlp` (fused SwiGLU, hidden rebuilt by the backward kernel, one gate/up weight-gradient matmul);
- every ``{Llama,Qwen2,Mistral}Attention`` → its instance ``forward`` becomes
  `megalith.policies.attention.attention_forward` with the rotary kernel (``"rope"``) and/or q, k
  and v as one matmul over the concatenated weights (``"qkv"``, plain ``nn.Linear`` projections
  only); per module, so other models of the family in the process keep HF's code;
- the CausalLM's instance ``forward``: when ``labels`` are given, the LM head and the shifted
  cross-entropy run as `fused_linear_cross_entropy` and the output has ``logits=None`` (with
  ``return_dict=False``, HF's tuple without the logits: ``(loss, past_key_values, ...)``); without
  labels the class forward runs unchanged.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from types import MethodType
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from megalith.common.errors import ConfigError
from megalith.kernels import KernelRMSNorm, fused_linear_cross_entropy, swiglu_mlp
from megalith.policies.attention import attention_forward, fusable_qkv

logger = logging.getLogger(__name__)

FAMILIES = ("Llama", "Qwen2", "Mistral")
KERNELS = ("rms_norm", "rope", "swiglu", "cross_entropy", "qkv")  # what `apply_kernels(only=...)` may name
_ATTR = "_megalith_kernel_patch"


@dataclass
class KernelPatch:
    """What was changed on one model, so it can be undone."""

    modules: list[tuple[nn.Module, str, nn.Module]] = field(default_factory=list)  # parent, attr, original
    forwards: list[nn.Module] = field(default_factory=list)  # modules given an instance forward
    rope: int = 0  # attention modules running the rotary kernel

    def summary(self) -> dict[str, int]:
        return {"rms_norm": len(self.modules), "forwards": len(self.forwards), "rope": self.rope}


def _family(model: nn.Module) -> str:
    name = type(model).__name__
    for fam in FAMILIES:
        if name.startswith(fam):
            return fam
    raise ConfigError(
        f"kernels: no kernel policy for {name}; supported: " + ", ".join(f"{f}ForCausalLM" for f in FAMILIES)
    )


def _mlp_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    return swiglu_mlp(x, self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight)


def _fusable_mlp(module: nn.Module) -> bool:
    projections = [getattr(module, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    act = type(getattr(module, "act_fn", None)).__name__
    return all(isinstance(p, nn.Linear) and p.bias is None for p in projections) and act in (
        "SiLU",
        "SiLUActivation",
    )


def _causal_lm_forward(self: Any, *args: Any, labels: torch.Tensor | None = None, **kwargs: Any) -> Any:
    """LM head + shifted cross-entropy as one fused kernel when labels are given (logits=None)."""
    if labels is None:
        return type(self).forward(self, *args, **kwargs)
    from transformers.modeling_outputs import CausalLMOutputWithPast

    kwargs.pop("logits_to_keep", None)
    # HF's `can_return_tuple`: return_dict=False (passed, or the config's) gives `.to_tuple()`, the
    # loss first and the None logits left out; the base model is asked for its output object.
    return_dict = kwargs.pop("return_dict", None)
    if return_dict is None:
        return_dict = getattr(self.config, "return_dict", True)
    num_items = kwargs.get("num_items_in_batch")
    out = self.model(*args, return_dict=True, **kwargs)
    hidden = out.last_hidden_state
    shifted = kwargs.get("shift_labels")
    if shifted is None:
        shifted = F.pad(labels, (0, 1), value=-100)[..., 1:]
    weight = self.lm_head.weight
    loss = fused_linear_cross_entropy(
        hidden.reshape(-1, hidden.shape[-1]).to(weight.dtype),
        weight,
        shifted.reshape(-1).to(hidden.device),
        ignore_index=-100,
        reduction="mean" if num_items is None else "sum",
    )
    if num_items is not None:
        loss = loss / num_items
    result = CausalLMOutputWithPast(  # type: ignore[call-arg]
        loss=loss,
        logits=None,
        past_key_values=out.past_key_values,
        hidden_states=out.hidden_states,
        attentions=out.attentions,
    )
    return result if return_dict else result.to_tuple()


def _swap_modules(model: nn.Module, family: str, patch: KernelPatch, chosen: frozenset[str]) -> None:
    for parent in list(model.modules()):
        for attr, child in list(parent.named_children()):
            kind = type(child).__name__
            if kind == f"{family}RMSNorm" and "rms_norm" in chosen:
                eps = float(getattr(child, "variance_epsilon", getattr(child, "eps", 1e-6)))
                setattr(parent, attr, KernelRMSNorm(cast(nn.Parameter, child.weight), eps))
                patch.modules.append((parent, attr, child))
            elif kind == f"{family}MLP" and "swiglu" in chosen and _fusable_mlp(child):
                child.forward = MethodType(_mlp_forward, child)
                patch.forwards.append(child)
            elif kind == f"{family}Attention":
                fuse, rope = "qkv" in chosen and fusable_qkv(child), "rope" in chosen
                if fuse or rope:
                    child.forward = MethodType(attention_forward(fuse, rope), child)
                    patch.forwards.append(child)
                    patch.rope += rope


def kernel_set(only: Iterable[str] | None) -> frozenset[str]:
    """The kernels named by `only` (None: all of `KERNELS`); an unknown name is a ConfigError."""
    if only is None:
        return frozenset(KERNELS)
    chosen = frozenset([only] if isinstance(only, str) else only)
    unknown = sorted(chosen - set(KERNELS))
    if unknown:
        raise ConfigError(f"kernels: unknown kernel name(s) {unknown}; choose from {list(KERNELS)}")
    return chosen


def apply_kernels(model: nn.Module, only: Iterable[str] | None = None) -> KernelPatch:
    """Swap the kernels into `model` in place (see the module docstring); returns what changed.

    `only` limits the swap to some of `KERNELS` (e.g. leave RMSNorm and RoPE to `torch.compile`,
    which fuses them with the residual adds around them, or keep HF's loss and logits)."""
    chosen = kernel_set(only)
    if getattr(model, _ATTR, None) is not None:
        raise ConfigError(f"kernels are already applied to this {type(model).__name__}")
    family = _family(model)
    patch = KernelPatch()
    _swap_modules(model, family, patch, chosen)
    head = getattr(model, "lm_head", None)
    if (
        "cross_entropy" in chosen
        and isinstance(head, nn.Linear)
        and head.bias is None
        and hasattr(model, "model")
    ):
        model.forward = MethodType(_causal_lm_forward, model)
        patch.forwards.append(model)
    setattr(model, _ATTR, patch)
    logger.info("kernels applied to %s: %s", type(model).__name__, patch.summary())
    return patch


def remove_kernels(model: nn.Module) -> None:
    """Undo `apply_kernels` (modules back, instance forwards removed)."""
    patch: KernelPatch | None = getattr(model, _ATTR, None)
    if patch is None:
        raise ConfigError(f"no kernels were applied to this {type(model).__name__}")
    for parent, attr, original in patch.modules:
        setattr(parent, attr, original)
    for module in patch.forwards:
        del module.forward
    delattr(model, _ATTR)
