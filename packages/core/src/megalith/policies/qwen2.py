"""Policy for HF `Qwen2ForCausalLM`: Llama's module layout (q/k/v carry biases, which
column-parallel layers shard with their rows; sliding-window layers only change the mask)."""

from __future__ import annotations

from megalith.policies.base import Policy
from megalith.policies.llama import DECODER_PLAN

QWEN2 = Policy(name="qwen2", model_classes=("Qwen2ForCausalLM",), plan=DECODER_PLAN)
