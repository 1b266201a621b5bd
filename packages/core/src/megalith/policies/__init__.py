"""Declarative parallel plans for HF model families, picked by model class (layer 6)."""

from torch import nn

from megalith.policies.base import HOW_TO, Policy, PolicyRegistry
from megalith.policies.llama import DECODER_PLAN, LLAMA
from megalith.policies.mistral import MISTRAL
from megalith.policies.qwen2 import QWEN2

REGISTRY = PolicyRegistry()
for _policy in (LLAMA, QWEN2, MISTRAL):
    REGISTRY.register(_policy)


def register_policy(policy: Policy) -> None:
    """Make `policy` the automatic choice for its `model_classes`."""
    REGISTRY.register(policy)


def policy_for(model: nn.Module) -> Policy:
    """The registered policy for `model`'s class; `ConfigError` listing the supported ones otherwise."""
    return REGISTRY.pick(model)


__all__ = [
    "DECODER_PLAN",
    "HOW_TO",
    "LLAMA",
    "MISTRAL",
    "QWEN2",
    "REGISTRY",
    "Policy",
    "PolicyRegistry",
    "policy_for",
    "register_policy",
]
