"""Format rewards: does the completion follow the ``<think>...</think><answer>...</answer>`` layout?"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

THINK_ANSWER_RE = re.compile(r"\s*<think>(.+?)</think>\s*<answer>(.+?)</answer>\s*", re.DOTALL)
ANSWER_ONLY_RE = re.compile(r"(?:(?!<answer>).)*<answer>(.+?)</answer>\s*", re.DOTALL)


def _once(text: str, *tags: str) -> bool:
    return all(text.count(f"<{t}>") == 1 and text.count(f"</{t}>") == 1 for t in tags)


def think_answer_format_reward(completion: str, sample: Mapping[str, Any]) -> float:
    """1.0 if the whole completion is ``<think>X</think><answer>Y</answer>`` (whitespace between
    allowed, each tag exactly once, ``X`` and ``Y`` non-blank), else 0.0 -- the DeepSeek-R1 format."""
    match = THINK_ANSWER_RE.fullmatch(completion)
    if match is None or not _once(completion, "think", "answer"):
        return 0.0
    return 1.0 if match.group(1).strip() and match.group(2).strip() else 0.0


def answer_format_reward(completion: str, sample: Mapping[str, Any]) -> float:
    """1.0 if the completion contains exactly one non-blank ``<answer>Y</answer>`` and ends with it
    (free text, e.g. reasoning, may precede it), else 0.0."""
    match = ANSWER_ONLY_RE.fullmatch(completion)
    if match is None or not _once(completion, "answer"):
        return 0.0
    return 1.0 if match.group(1).strip() else 0.0
