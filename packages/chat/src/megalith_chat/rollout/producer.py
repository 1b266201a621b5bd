"""Rollout production: sample ``G`` responses per prompt, score them, filter groups, emit a batch.

:class:`RolloutWorker` is plain Python (no Ray); the Ray producer actor wraps one.

* **rewards** go through :class:`~megalith_chat.rewards.RewardRunner`: a reward function that
  raises, returns garbage or exceeds ``reward_timeout_s`` scores 0 and is counted
  (``RolloutBatch.reward_errors``), and production continues;
* **overlong** responses (no end-of-sequence within ``max_new_tokens``): ``"mask"`` removes
  them from the loss (DAPO's overlong filtering), ``"penalty"`` subtracts ``overlong_penalty``
  from their reward, ``"none"`` keeps them as they are;
* **dynamic sampling** (DAPO, Yu et al. 2025): groups whose ``G`` rewards are all equal have zero
  advantage and teach nothing; they are dropped and new prompts are sampled until
  ``prompts_per_batch`` informative groups are collected or ``max_refill_rounds`` is reached.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from megalith.common.errors import ConfigError
from megalith_chat.data.datasets import PromptExample
from megalith_chat.messages import RolloutBatch
from megalith_chat.rewards import RewardFunction, RewardRunner
from megalith_chat.rollout.batching import concat_batches
from megalith_chat.rollout.generation import Generated, SamplingConfig, generate, pad_token_id

logger = logging.getLogger(__name__)

OVERLONG_MODES = ("mask", "penalty", "none")


@dataclass(frozen=True)
class RolloutConfig:
    """What a producer generates per batch (see module docstring)."""

    group_size: int = 8
    prompts_per_batch: int = 2
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    dynamic_sampling: bool = True
    max_refill_rounds: int = 4
    overlong: str = "mask"
    overlong_penalty: float = 0.5
    reward_timeout_s: float = 10.0
    accuracy_threshold: float = 1.0
    response_prefix: str = ""

    def __post_init__(self) -> None:
        if self.group_size < 1 or self.prompts_per_batch < 1:
            raise ConfigError(
                f"need group_size >= 1 and prompts_per_batch >= 1, got {self.group_size}, {self.prompts_per_batch}"
            )
        if self.dynamic_sampling and self.group_size < 2:
            raise ConfigError("dynamic sampling needs group_size >= 2 (a group of one has no variance)")
        if self.overlong not in OVERLONG_MODES:
            raise ConfigError(f"overlong must be one of {OVERLONG_MODES}, got {self.overlong!r}")
        if self.max_refill_rounds < 1 or self.reward_timeout_s <= 0:
            raise ConfigError("need max_refill_rounds >= 1 and reward_timeout_s > 0")


class PromptStream:
    """An endless, reproducible stream over the prompts: a fresh seeded shuffle every epoch.

    ``position`` (prompts handed out so far) is all the state needed to resume the stream.
    """

    def __init__(self, prompts: Sequence[PromptExample], seed: int, position: int = 0) -> None:
        if not prompts:
            raise ConfigError("the prompt dataset is empty")
        self.prompts, self.seed, self.position = list(prompts), seed, 0
        self._order: list[int] = []
        self._epoch = -1
        for _ in range(position):
            self.next()

    def next(self) -> PromptExample:
        epoch, index = divmod(self.position, len(self.prompts))
        if epoch != self._epoch:
            self._order = list(range(len(self.prompts)))
            random.Random(self.seed * 1_000_003 + epoch).shuffle(self._order)
            self._epoch = epoch
        self.position += 1
        return self.prompts[self._order[index]]


class RolloutWorker:
    """Generates scored :class:`RolloutBatch` messages with a local copy of the policy."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        stream: PromptStream,
        reward_fn: RewardFunction,
        config: RolloutConfig,
        producer_id: int = 0,
        generate_fn: Callable[..., Generated] | None = None,
    ) -> None:
        """``generate_fn`` replaces HF :func:`generate` (same signature), e.g. the fast engine's."""
        self.model, self.tokenizer, self.stream = model, tokenizer, stream
        self.generate_fn = generate_fn or generate
        self.reward_fn, self.config, self.producer_id = reward_fn, config, producer_id
        self.runner = RewardRunner(timeout_s=config.reward_timeout_s)

    def _score(self, gen: Generated, prompts: Sequence[PromptExample]) -> tuple[torch.Tensor, int]:
        g = self.config.group_size
        scores, errors = [], 0
        for i, text in enumerate(gen.texts):
            result = self.runner(self.reward_fn, text, prompts[i // g].reward_sample())
            scores.append(result.score)
            errors += int(not result.ok)
        return torch.tensor(scores, dtype=torch.float32), errors

    def _round(self, num_prompts: int, version: int) -> tuple[RolloutBatch, dict[str, float]]:
        """Generate and score ``num_prompts`` groups (unfiltered) plus round statistics."""
        prompts = [self.stream.next() for _ in range(num_prompts)]
        t0 = time.perf_counter()
        gen = self.generate_fn(
            self.model,
            self.tokenizer,
            [p.prompt for p in prompts],
            self.config.group_size,
            self.config.sampling,
            self.config.response_prefix,
        )
        t1 = time.perf_counter()
        rewards, errors = self._score(gen, prompts)
        t2 = time.perf_counter()
        raw = rewards.clone()
        mask = gen.response_mask
        if self.config.overlong == "mask":
            mask = mask * (~gen.truncated).long().unsqueeze(1)
        elif self.config.overlong == "penalty":
            rewards = rewards - self.config.overlong_penalty * gen.truncated.float()
        batch = RolloutBatch(
            gen.prompt_ids,
            gen.prompt_mask,
            gen.response_ids,
            mask,
            gen.logprobs,
            rewards,
            self.config.group_size,
            version,
            self.producer_id,
            errors,
        )
        lengths = gen.response_mask.sum(dim=1).float()
        stats = {
            "reward_sum": float(raw.sum()),
            "reward_sq_sum": float((raw**2).sum()),
            "correct": float((raw >= self.config.accuracy_threshold).sum()),
            "samples": float(raw.numel()),
            "tokens": float(lengths.sum()),
            "truncated": float(gen.truncated.sum()),
            "generate_s": t1 - t0,
            "reward_s": t2 - t1,
        }
        return batch, stats

    def _informative(self, batch: RolloutBatch) -> list[int]:
        groups = batch.rewards.view(-1, batch.group_size)
        varied = groups.amax(dim=1) != groups.amin(dim=1)
        has_tokens = (
            batch.response_mask.view(-1, batch.group_size, batch.response_mask.shape[1]).sum((1, 2)) > 0
        )
        return [i for i in range(groups.shape[0]) if bool(varied[i]) and bool(has_tokens[i])]

    def make_batch(self, version: int) -> RolloutBatch | None:
        """One batch of up to ``prompts_per_batch`` groups, or ``None`` if every group was dropped."""
        from megalith_chat.rollout.batching import select_groups

        want = self.config.prompts_per_batch
        kept: list[RolloutBatch] = []
        totals: dict[str, float] = {}
        have = dropped = errors = 0
        for _ in range(self.config.max_refill_rounds):
            batch, stats = self._round(want - have, version)
            for k, v in stats.items():
                totals[k] = totals.get(k, 0.0) + v
            errors += batch.reward_errors
            keep = (
                self._informative(batch) if self.config.dynamic_sampling else list(range(batch.num_prompts))
            )
            dropped += batch.num_prompts - len(keep)
            kept.extend(select_groups(batch, i, i + 1) for i in keep)
            have += len(keep)
            if have >= want:
                break
        metrics = _summarise(totals, dropped)
        if not kept:
            logger.info("producer %d: every group of this batch had zero reward variance", self.producer_id)
            return None
        metrics["prompt_position"] = float(self.stream.position)
        joined = concat_batches(kept, pad_token_id(self.tokenizer))
        return replace(joined, reward_errors=errors, metrics=metrics)


def _summarise(totals: dict[str, float], dropped: int) -> dict[str, float]:
    n = max(totals.get("samples", 0.0), 1.0)
    mean = totals.get("reward_sum", 0.0) / n
    var = max(totals.get("reward_sq_sum", 0.0) / n - mean**2, 0.0)
    gen_s = totals.get("generate_s", 0.0)
    return {
        "reward_mean": mean,
        "reward_std": var**0.5,
        "accuracy": totals.get("correct", 0.0) / n,
        "response_length": totals.get("tokens", 0.0) / n,
        "truncated_frac": totals.get("truncated", 0.0) / n,
        "rollout_tokens_per_s": totals.get("tokens", 0.0) / gen_s if gen_s > 0 else 0.0,
        "generate_s": gen_s,
        "reward_s": totals.get("reward_s", 0.0),
        "groups_dropped": float(dropped),
        "samples": n,
    }
