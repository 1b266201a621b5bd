"""Policy for HF `MistralForCausalLM`: Llama's module layout (GQA, optional sliding window, which
only changes the attention mask the model builds for the full sequence)."""

from __future__ import annotations

from megalith.policies.base import Policy
from megalith.policies.llama import DECODER_PLAN

MISTRAL = Policy(name="mistral", model_classes=("MistralForCausalLM",), plan=DECODER_PLAN)
