"""Verifiable rewards (math, format, sandboxed code), weighted composition, and a safe runner.

A reward function is ``fn(completion: str, sample: Mapping[str, Any]) -> float``; see
:mod:`megalith_chat.rewards.runner` for how failures and timeouts are handled.
"""

from megalith_chat.rewards.code import (
    CodeReward,
    SandboxLimits,
    SandboxResult,
    code_reward,
    extract_code,
    network_isolation_available,
    run_python_sandboxed,
)
from megalith_chat.rewards.compose import (
    BUILTIN_REWARDS,
    CompositeRewardResult,
    RewardComponent,
    WeightedReward,
    check_reward_spec,
    load_reward_function,
    parse_reward_spec,
)
from megalith_chat.rewards.format import answer_format_reward, think_answer_format_reward
from megalith_chat.rewards.math_answer import (
    answers_match,
    exact_answer_reward,
    extract_answer,
    math_reward,
    normalize_answer,
    parse_math,
)
from megalith_chat.rewards.runner import RewardFunction, RewardResult, RewardRunner, RewardStats

__all__ = [
    "BUILTIN_REWARDS",
    "CodeReward",
    "CompositeRewardResult",
    "RewardComponent",
    "RewardFunction",
    "RewardResult",
    "RewardRunner",
    "RewardStats",
    "SandboxLimits",
    "SandboxResult",
    "WeightedReward",
    "answer_format_reward",
    "answers_match",
    "check_reward_spec",
    "code_reward",
    "exact_answer_reward",
    "extract_answer",
    "extract_code",
    "load_reward_function",
    "math_reward",
    "network_isolation_available",
    "normalize_answer",
    "parse_math",
    "parse_reward_spec",
    "run_python_sandboxed",
    "think_answer_format_reward",
]
