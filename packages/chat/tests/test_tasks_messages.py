"""Built-in verifiable tasks and the producer/consumer message types."""

from __future__ import annotations

import re

import pytest
import torch

from megalith.common.errors import ConfigError, DataError
from megalith_chat.data import arithmetic_task, get_task, reverse_digits_task
from megalith_chat.data.tasks import arithmetic_reward, reverse_reward
from megalith_chat.messages import RolloutBatch, WeightSyncDone


def test_arithmetic_answers_are_correct_and_deterministic() -> None:
    prompts = arithmetic_task(50, seed=3)
    assert prompts == arithmetic_task(50, seed=3)
    assert prompts != arithmetic_task(50, seed=4)
    ops = set()
    for p in prompts:
        text = p.prompt[0]["content"]
        a, op, b = re.match(r"What is (\d+) ([-+*]) (\d+)\?", text).groups()  # type: ignore[union-attr]
        expected = {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
        assert p.answer == str(expected) and 0 <= int(a) <= 50 and 0 <= int(b) <= 50
        assert "<answer></answer>" in text
        ops.add(op)
    assert ops == {"+", "-", "*"}


def test_reverse_task() -> None:
    prompts = reverse_digits_task(30, seed=1, min_len=3, max_len=5)
    for p in prompts:
        digits = re.search(r"digit string (\d+)\.", p.prompt[0]["content"]).group(1)  # type: ignore[union-attr]
        assert 3 <= len(digits) <= 5 and p.answer == digits[::-1]
    small = reverse_digits_task(40, seed=2, min_len=2, max_len=2, digits="01234")
    seen = {re.search(r"digit string (\d+)\.", p.prompt[0]["content"]).group(1) for p in small}  # type: ignore[union-attr]
    assert all(len(s) == 2 and set(s) <= set("01234") for s in seen) and len(seen) > 5


def test_task_rewards_by_hand() -> None:
    sample = {"answer": "42"}
    assert arithmetic_reward("<answer>42</answer>", sample) == pytest.approx(1.2)  # correct + 0.2 format
    assert arithmetic_reward("so <answer>41</answer>", sample) == pytest.approx(0.2)  # format only
    assert arithmetic_reward("42", sample) == 0.0
    zeros = {"answer": "021"}
    assert reverse_reward("<answer>021</answer>", zeros) == pytest.approx(1.2)
    assert reverse_reward("<answer>21</answer>", zeros) == pytest.approx(0.2)  # a number, but wrong digits


def test_task_registry_and_bad_options() -> None:
    assert get_task("reverse").generate(2, 0) == reverse_digits_task(2, 0)
    with pytest.raises(ConfigError, match="'sorting'"):
        get_task("sorting")
    with pytest.raises(ConfigError, match=r"got '\+/'"):
        arithmetic_task(3, ops="+/")
    with pytest.raises(ConfigError, match="min_len"):
        reverse_digits_task(3, min_len=5, max_len=2)
    with pytest.raises(ConfigError, match="'0a1'"):
        reverse_digits_task(3, digits="0a1")
    with pytest.raises(ConfigError, match="'112'"):
        reverse_digits_task(3, digits="112")


def _batch(**overrides: object) -> RolloutBatch:
    fields: dict[str, object] = {
        "prompt_ids": torch.zeros(4, 3, dtype=torch.long),
        "prompt_mask": torch.ones(4, 3),
        "response_ids": torch.zeros(4, 5, dtype=torch.long),
        "response_mask": torch.tensor([[1, 1, 0, 0, 0]] * 4),
        "rollout_logprobs": torch.zeros(4, 5),
        "rewards": torch.zeros(4),
        "group_size": 2,
        "weight_version": 7,
        "producer_id": 1,
    }
    fields.update(overrides)
    return RolloutBatch(**fields)  # type: ignore[arg-type]


def test_rollout_batch_shapes_and_counts() -> None:
    batch = _batch()
    assert (batch.num_samples, batch.num_prompts, batch.num_response_tokens) == (4, 2, 8)
    with pytest.raises(DataError, match=r"rollout_logprobs has shape \(4, 4\), expected \(4, 5\)"):
        _batch(rollout_logprobs=torch.zeros(4, 4))
    with pytest.raises(DataError, match=r"rewards has shape \(3,\)"):
        _batch(rewards=torch.zeros(3))
    with pytest.raises(DataError, match="group_size=3"):
        _batch(group_size=3)
    with pytest.raises(AttributeError):
        batch.weight_version = 8  # type: ignore[misc]
    assert WeightSyncDone(producer_id=0, weight_version=3, seconds=0.5).weight_version == 3
