"""Prompt datasets for GRPO runs: a built-in task (with options) or a JSONL prompt file, and
the reward function of a run (a task's reward or a reward spec)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from megalith.common.errors import ConfigError
from megalith_chat.data.datasets import PromptExample, load_prompt_dataset
from megalith_chat.data.tasks import get_task
from megalith_chat.rewards import RewardFunction, load_reward_function, parse_reward_spec

TASK_OPTIONS = {"arithmetic": ("max_operand", "ops"), "reverse": ("min_len", "max_len", "digits")}


def _task_prompts(task: str, num: int, seed: int, options: dict[str, Any]) -> list[PromptExample]:
    allowed = TASK_OPTIONS.get(task, ())
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ConfigError(f"task {task!r} has no option(s) {unknown}; it accepts {list(allowed)}")
    from megalith_chat.data import tasks

    # the tasks differ in their keyword options (checked above against TASK_OPTIONS)
    makers: dict[str, Callable[..., list[PromptExample]]] = {
        "arithmetic": tasks.arithmetic_task,
        "reverse": tasks.reverse_digits_task,
    }
    return makers[get_task(task).name](num, seed, **options)


class WeightedSum:
    """``sum_i w_i f_i(completion, sample)`` without per-term isolation (the caller's runner isolates)."""

    def __init__(self, spec: str) -> None:
        self.spec = spec
        self.components = parse_reward_spec(spec)

    def __call__(self, completion: str, sample: Mapping[str, Any]) -> float:
        return sum(c.weight * float(c.fn(completion, sample)) for c in self.components)


def resolve_reward(spec: str) -> RewardFunction:
    """A task name (``arithmetic``/``reverse``), a single reward, or a weighted spec ``a=1,b=0.2``."""
    from megalith_chat.data.tasks import TASKS

    if spec in TASKS:
        return TASKS[spec].reward
    if "," in spec or "=" in spec:
        return WeightedSum(spec)
    return load_reward_function(spec)


def _with_system(prompts: list[PromptExample], system: str | None) -> list[PromptExample]:
    """Put ``system`` first in every prompt that has no system turn; one that has keeps its own."""
    if system is None:
        return prompts
    return [
        p
        if any(m["role"] == "system" for m in p.prompt)
        else replace(p, prompt=({"role": "system", "content": system}, *p.prompt))
        for p in prompts
    ]


def load_prompts(src: Any) -> list[PromptExample]:
    """The training prompts of a :class:`~megalith_chat.engine.config.PromptSource`."""
    if src.prompts_file is not None:
        prompts = load_prompt_dataset(src.prompts_file)
    else:
        prompts = _task_prompts(src.task, src.num_prompts, src.seed, dict(src.task_options))
    return _with_system(prompts, src.system_prompt)


def eval_prompts(src: Any, num: int) -> list[PromptExample]:
    """``num`` evaluation prompts: a task with another seed, or the first ``num`` of the file."""
    if num < 1:
        raise ConfigError(f"need at least one evaluation prompt, got {num}")
    if src.prompts_file is not None:
        return load_prompts(src)[:num]
    return _with_system(_task_prompts(src.task, num, src.seed + 1, dict(src.task_options)), src.system_prompt)
