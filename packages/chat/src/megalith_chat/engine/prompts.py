"""Prompt datasets for GRPO runs: a built-in task (with options) or a JSONL prompt file."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from megalith.common.errors import ConfigError
from megalith_chat.data.datasets import PromptExample, load_prompt_dataset
from megalith_chat.data.tasks import get_task

TASK_OPTIONS = {"arithmetic": ("max_operand", "ops"), "reverse": ("min_len", "max_len", "digits")}


def _task_prompts(task: str, num: int, seed: int, options: dict[str, Any]) -> list[PromptExample]:
    allowed = TASK_OPTIONS.get(task, ())
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ConfigError(f"task {task!r} has no option(s) {unknown}; it accepts {list(allowed)}")
    from megalith_chat.data import tasks

    fn = {"arithmetic": tasks.arithmetic_task, "reverse": tasks.reverse_digits_task}[get_task(task).name]
    return fn(num, seed, **options)


def _with_system(prompts: list[PromptExample], system: str | None) -> list[PromptExample]:
    if system is None:
        return prompts
    out = []
    for p in prompts:
        turns = tuple(m for m in p.prompt if m["role"] != "system")
        out.append(replace(p, prompt=({"role": "system", "content": system}, *turns)))
    return out


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
