"""Built-in verifiable tasks for GRPO: deterministic prompt generators and their rewards.

* ``arithmetic``: "What is 17 + 25?" with ``+``, ``-``, ``*``; the answer is an integer.
* ``reverse``: "Reverse the digit string 40721." -> ``"12704"`` (leading zeros matter, so the
  answer is compared as an exact string); a toy task small models can learn quickly.

Each prompt asks for the final answer inside ``<answer></answer>``. The task reward is
``correctness + FORMAT_WEIGHT * format`` with ``correctness, format`` in ``{0, 1}``.
Generation is a pure function of ``(num, seed, options)``.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from megalith.common.errors import ConfigError
from megalith_chat.data.datasets import PromptExample
from megalith_chat.rewards.format import answer_format_reward
from megalith_chat.rewards.math_answer import exact_answer_reward, math_reward

FORMAT_WEIGHT = 0.2
ANSWER_INSTRUCTION = "Give only the final answer inside <answer></answer>."


def _prompt(text: str, answer: str, task: str, index: int) -> PromptExample:
    content = f"{text} {ANSWER_INSTRUCTION}"
    return PromptExample(({"role": "user", "content": content},), answer, {"task": task}, f"{task}#{index}")


def arithmetic_task(num: int, seed: int = 0, max_operand: int = 50, ops: str = "+-*") -> list[PromptExample]:
    """``num`` prompts "What is a <op> b?" with ``0 <= a, b <= max_operand``, reproducible from ``seed``."""
    if num < 0 or max_operand < 1:
        raise ConfigError(f"need num >= 0 and max_operand >= 1, got num={num}, max_operand={max_operand}")
    if not ops or set(ops) - set("+-*"):
        raise ConfigError(f"ops must be a non-empty subset of '+-*', got {ops!r}")
    rng = random.Random(seed)
    out = []
    for i in range(num):
        a, b, op = rng.randint(0, max_operand), rng.randint(0, max_operand), rng.choice(ops)
        value = a + b if op == "+" else a - b if op == "-" else a * b
        out.append(_prompt(f"What is {a} {op} {b}?", str(value), "arithmetic", i))
    return out


def reverse_digits_task(
    num: int, seed: int = 0, min_len: int = 3, max_len: int = 6, digits: str = "0123456789"
) -> list[PromptExample]:
    """``num`` prompts "Reverse the digit string d1d2...dn." with ``min_len <= n <= max_len``.

    Each ``d_i`` is drawn uniformly from ``digits`` (e.g. ``"01234"`` for a smaller answer space:
    ``len(digits) ** n`` distinct strings of length ``n``).
    """
    if num < 0 or not 1 <= min_len <= max_len:
        raise ConfigError(f"need num >= 0 and 1 <= min_len <= max_len, got {num}, {min_len}, {max_len}")
    if not digits or not digits.isdigit() or len(set(digits)) != len(digits):
        raise ConfigError(f"digits must be distinct decimal digits, e.g. '01234', got {digits!r}")
    rng = random.Random(seed)
    out = []
    for i in range(num):
        string = "".join(rng.choice(digits) for _ in range(rng.randint(min_len, max_len)))
        out.append(_prompt(f"Reverse the digit string {string}.", string[::-1], "reverse", i))
    return out


def arithmetic_reward(completion: str, sample: Mapping[str, Any]) -> float:
    """``math_reward + FORMAT_WEIGHT * answer_format_reward`` (max ``1 + FORMAT_WEIGHT``)."""
    return math_reward(completion, sample) + FORMAT_WEIGHT * answer_format_reward(completion, sample)


def reverse_reward(completion: str, sample: Mapping[str, Any]) -> float:
    """``exact_answer_reward + FORMAT_WEIGHT * answer_format_reward`` (max ``1 + FORMAT_WEIGHT``)."""
    return exact_answer_reward(completion, sample) + FORMAT_WEIGHT * answer_format_reward(completion, sample)


@dataclass(frozen=True)
class Task:
    """A named built-in task: prompt generator ``(num, seed) -> prompts`` and its reward."""

    name: str
    generate: Callable[[int, int], list[PromptExample]]
    reward: Callable[[str, Mapping[str, Any]], float]


TASKS: Mapping[str, Task] = {
    "arithmetic": Task("arithmetic", arithmetic_task, arithmetic_reward),
    "reverse": Task("reverse", reverse_digits_task, reverse_reward),
}


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise ConfigError(f"unknown task {name!r}; expected one of {sorted(TASKS)}")
    return TASKS[name]
