"""Policies: declarative tensor/sequence-parallel plans for model families, picked by model class.

A policy is data: the model classes it fits, a `TensorParallelPlan` (module-name patterns → parallel
style) and the config attributes holding the head counts. Nothing here imports a model library or
copies a forward function, so a library upgrade that keeps module names keeps the policy working;
one that renames modules fails loudly (a pattern that matches nothing is a `ConfigError`).

To support another model, write a policy and pass it to `HybridPlugin(policy=...)` or register it:

    MY_POLICY = Policy(
        name="my-model",
        model_classes=("MyForCausalLM",),
        plan=TensorParallelPlan(layers={
            "model.embed_tokens": "vocab_embedding",
            "model.layers.*.attn.qkv": "colwise",      # fused: plan.fused = {"*.qkv": (q, k, v)}
            "model.layers.*.attn.out": "rowwise",
            "lm_head": "vocab_head",
        }, attention="model.layers.*.attn", sequence_start="model.layers.0"),
    )
    register_policy(MY_POLICY)
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from torch import nn

from megalith.common.errors import ConfigError
from megalith.tensor_parallel import TensorParallelPlan


@dataclass(frozen=True)
class Policy:
    """`plan` for every model whose class (or a base class) is named in `model_classes`; the head
    counts and hidden size are read from `model.config` attributes of the given names."""

    name: str
    model_classes: tuple[str, ...]
    plan: TensorParallelPlan
    heads_attr: str = "num_attention_heads"
    kv_heads_attr: str = "num_key_value_heads"
    hidden_attr: str = "hidden_size"

    def plan_for(self, model: nn.Module) -> TensorParallelPlan:
        """The plan with this model's head counts filled in (for the divisibility checks)."""
        config = getattr(model, "config", None)

        def read(attr: str) -> int | None:
            value = getattr(config, attr, None)
            return value if isinstance(value, int) else None

        heads = read(self.heads_attr)
        kv = read(self.kv_heads_attr)
        return replace(
            self.plan,
            num_heads=heads,
            num_kv_heads=kv if kv is not None else heads,
            hidden_size=read(self.hidden_attr),
        )


HOW_TO = (
    "write a megalith.policies.Policy (module-name patterns → 'colwise' | 'rowwise' | 'vocab_embedding' | "
    "'vocab_head', see megalith/policies/base.py) and pass it as HybridPlugin(policy=...) or register_policy() it"
)


class PolicyRegistry:
    """Model class name → policy. `pick(model)` walks the model's class hierarchy (MRO)."""

    def __init__(self) -> None:
        self._by_class: dict[str, Policy] = {}

    def register(self, policy: Policy) -> None:
        for cls in policy.model_classes:
            self._by_class[cls] = policy

    def supported(self) -> list[str]:
        return sorted(self._by_class)

    def pick(self, model: nn.Module) -> Policy:
        for cls in type(model).__mro__:
            if cls.__name__ in self._by_class:
                return self._by_class[cls.__name__]
        raise ConfigError(
            f"no tensor-parallel policy for {type(model).__name__}; supported classes: "
            f"{', '.join(self.supported())}. For other models, {HOW_TO}"
        )
