"""Weighted composition of reward functions, and loading them by name or import path.

A reward *spec* is a comma-separated list of ``name=weight`` (weight defaults to 1), where
``name`` is a built-in (:data:`BUILTIN_REWARDS`) or an import path ``"pkg.module:function"``::

    "math=1.0,think_format=0.1,my_rewards.length:brevity=0.5"
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from megalith.common.errors import ConfigError
from megalith_chat.rewards.code import code_reward
from megalith_chat.rewards.format import answer_format_reward, think_answer_format_reward
from megalith_chat.rewards.math_answer import exact_answer_reward, math_reward
from megalith_chat.rewards.runner import RewardFunction, RewardResult, RewardRunner

BUILTIN_REWARDS: Mapping[str, RewardFunction] = {
    "math": math_reward,
    "exact": exact_answer_reward,
    "think_format": think_answer_format_reward,
    "answer_format": answer_format_reward,
    "code": code_reward,
}


def load_reward_function(spec: str) -> RewardFunction:
    """A built-in reward by name, or ``"pkg.module:function"`` imported from the Python path."""
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(
            f"unknown reward {spec!r}: expected one of {sorted(BUILTIN_REWARDS)} or 'pkg.module:function'"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"cannot import module {module_name!r} of reward {spec!r}: {exc}") from exc
    fn = getattr(module, attr, None)
    if fn is None or not callable(fn):
        raise ConfigError(f"reward {spec!r}: module {module_name!r} has no callable {attr!r}")
    return fn


@dataclass(frozen=True)
class RewardComponent:
    """One term ``weight * fn(completion, sample)`` of a composite reward."""

    name: str
    fn: RewardFunction
    weight: float = 1.0

    def __post_init__(self) -> None:
        if not math.isfinite(self.weight):
            raise ConfigError(f"reward {self.name!r} has a non-finite weight {self.weight}")


@dataclass(frozen=True)
class CompositeRewardResult:
    """``total = sum_i weight_i * parts[i].score``; a failed part contributes 0."""

    total: float
    parts: tuple[tuple[str, RewardResult], ...]

    @property
    def num_errors(self) -> int:
        return sum(not r.ok for _, r in self.parts)

    @property
    def num_timeouts(self) -> int:
        return sum(r.timed_out for _, r in self.parts)


def _spec_items(spec: str) -> list[tuple[str, float]]:
    """``"math=1,think_format=0.1"`` -> ``[("math", 1.0), ("think_format", 0.1)]`` (no import)."""
    items = []
    for item in (part.strip() for part in spec.split(",")):
        if not item:
            continue
        name, sep, weight_text = item.rpartition("=")
        if not sep:
            name, weight_text = item, "1"
        try:
            weight = float(weight_text)
        except ValueError as exc:
            raise ConfigError(f"reward weight in {item!r} is not a number: {weight_text!r}") from exc
        items.append((name.strip(), weight))
    if not items:
        raise ConfigError(f"reward spec {spec!r} names no reward")
    return items


def check_reward_spec(spec: str) -> None:
    """:class:`ConfigError` for a malformed spec or an unknown built-in name, without importing
    anything: ``pkg.module:function`` paths are only checked for their form (they may be
    importable on the Ray workers only); :func:`parse_reward_spec` also imports them."""
    for name, weight in _spec_items(spec):
        module_name, sep, attr = name.partition(":")
        if name not in BUILTIN_REWARDS and not (sep and module_name and attr):
            raise ConfigError(
                f"unknown reward {name!r} in {spec!r}: expected one of {sorted(BUILTIN_REWARDS)} "
                "or 'pkg.module:function'"
            )
        if not math.isfinite(weight):
            raise ConfigError(f"reward {name!r} has a non-finite weight {weight}")


def parse_reward_spec(spec: str) -> tuple[RewardComponent, ...]:
    """``"math=1,think_format=0.1"`` -> components (see module docstring)."""
    return tuple(RewardComponent(name, load_reward_function(name), w) for name, w in _spec_items(spec))


class WeightedReward:
    """``R(y) = sum_i w_i r_i(y)``, each ``r_i`` run through a :class:`RewardRunner`.

    Calling the object returns the total, so a composite is itself a reward function.
    """

    def __init__(
        self, components: Sequence[RewardComponent] | str, runner: RewardRunner | None = None
    ) -> None:
        self.components = parse_reward_spec(components) if isinstance(components, str) else tuple(components)
        if not self.components:
            raise ConfigError("a weighted reward needs at least one component")
        names = [c.name for c in self.components]
        if len(set(names)) != len(names):
            raise ConfigError(f"reward component names must be unique, got {names}")
        self.runner = runner or RewardRunner()

    def score(self, completion: str, sample: Mapping[str, Any]) -> CompositeRewardResult:
        parts = tuple((c.name, self.runner(c.fn, completion, sample)) for c in self.components)
        total = sum(c.weight * result.score for c, (_, result) in zip(self.components, parts))
        return CompositeRewardResult(total, parts)

    def __call__(self, completion: str, sample: Mapping[str, Any]) -> float:
        return self.score(completion, sample).total
