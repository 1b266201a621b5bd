"""Reward runner (raising / hanging rewards score 0 and are counted), composition and loading by path."""

from __future__ import annotations

import sys
import textwrap
import time
import uuid
from pathlib import Path
from types import ModuleType

import pytest

from megalith.common.errors import ConfigError
from megalith_chat.rewards import (
    RewardComponent,
    RewardResult,
    RewardRunner,
    WeightedReward,
    load_reward_function,
    parse_reward_spec,
)

USER_REWARDS = textwrap.dedent(
    """
    import time

    def length_bonus(completion, sample):
        return len(completion) / 10

    def explode(completion, sample):
        raise RuntimeError("reward exploded on " + completion)

    def sleep_forever(completion, sample):
        while True:
            time.sleep(1)

    def not_a_number(completion, sample):
        return "high"

    def nan_score(completion, sample):
        return float("nan")

    NOT_CALLABLE = 3
    """
)


@pytest.fixture
def user_rewards(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """A user reward module importable by path (and by spawned worker processes)."""
    name = f"user_rewards_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(USER_REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    module = __import__(name)
    yield module
    sys.modules.pop(name, None)


def test_thread_runner_scores_and_counts(user_rewards: ModuleType) -> None:
    runner = RewardRunner(timeout_s=5.0)
    assert runner(user_rewards.length_bonus, "abcde", {}) == RewardResult(0.5)
    boom = runner(user_rewards.explode, "xyz", {})
    assert (boom.score, boom.timed_out) == (0.0, False)
    assert boom.error == "RuntimeError: reward exploded on xyz"
    assert "ValueError" in (runner(user_rewards.not_a_number, "", {}).error or "")
    assert "non-finite" in (runner(user_rewards.nan_score, "", {}).error or "")
    stats = runner.stats
    assert (stats.calls, stats.errors, stats.timeouts) == (4, 3, 0)


def test_thread_runner_bounds_a_reward_that_never_returns(user_rewards: ModuleType) -> None:
    runner = RewardRunner(timeout_s=0.3)
    start = time.monotonic()
    result = runner(user_rewards.sleep_forever, "", {})
    assert time.monotonic() - start < 5.0
    assert result.timed_out and result.score == 0.0
    assert "timed out after 0.3s" in (result.error or "")
    assert (runner.stats.timeouts, runner.stats.errors) == (1, 1)


def test_process_runner_kills_hung_worker_and_recovers(user_rewards: ModuleType) -> None:
    with RewardRunner(timeout_s=1.0, isolation="process", memory_mb=1024) as runner:
        assert runner(user_rewards.length_bonus, "0123456789", {}).score == pytest.approx(1.0)
        start = time.monotonic()
        hung = runner(user_rewards.sleep_forever, "", {})
        assert time.monotonic() - start < 10.0
        assert hung.timed_out and hung.score == 0.0
        boom = runner(user_rewards.explode, "q", {})  # served by a fresh worker
        assert boom.error == "RuntimeError: reward exploded on q"
        assert runner(user_rewards.length_bonus, "01234", {}).score == pytest.approx(0.5)
        assert (runner.stats.calls, runner.stats.errors, runner.stats.timeouts) == (4, 2, 1)


def test_process_runner_reports_unpicklable_function() -> None:
    with RewardRunner(timeout_s=5.0, isolation="process") as runner:
        result = runner(lambda c, s: 1.0, "", {})
    assert result.score == 0.0 and "cannot send" in (result.error or "")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"timeout_s": 0}, "timeout_s"),
        ({"isolation": "fork"}, "'fork'"),
        ({"memory_mb": 100}, "memory_mb=100"),
    ],
)
def test_runner_rejects_bad_config(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        RewardRunner(**kwargs)  # type: ignore[arg-type]


def test_load_reward_by_import_path(user_rewards: ModuleType) -> None:
    fn = load_reward_function(f"{user_rewards.__name__}:length_bonus")
    assert fn("abcdefghij", {}) == 1.0
    with pytest.raises(ConfigError, match="no callable 'NOT_CALLABLE'"):
        load_reward_function(f"{user_rewards.__name__}:NOT_CALLABLE")
    with pytest.raises(ConfigError, match="no_such_module_xyz"):
        load_reward_function("no_such_module_xyz:f")
    with pytest.raises(ConfigError, match="'mathh'"):
        load_reward_function("mathh")


def test_weighted_reward_sums_and_zeroes_failures(user_rewards: ModuleType) -> None:
    reward = WeightedReward(
        [
            RewardComponent("len", user_rewards.length_bonus, 2.0),
            RewardComponent("boom", user_rewards.explode, 5.0),
            RewardComponent("hang", user_rewards.sleep_forever, 1.0),
        ],
        runner=RewardRunner(timeout_s=0.3),
    )
    result = reward.score("abcd", {})
    assert result.total == pytest.approx(2.0 * 0.4)  # failed parts contribute 0
    assert (result.num_errors, result.num_timeouts) == (2, 1)
    assert [name for name, _ in result.parts] == ["len", "boom", "hang"]


def test_reward_spec_parsing(user_rewards: ModuleType) -> None:
    components = parse_reward_spec(f"math=1.0, think_format=0.25 ,{user_rewards.__name__}:length_bonus")
    assert [(c.name, c.weight) for c in components] == [
        ("math", 1.0),
        ("think_format", 0.25),
        (f"{user_rewards.__name__}:length_bonus", 1.0),
    ]
    reward = WeightedReward("math=1,think_format=0.5")
    # correct (1 * 1) + well formatted (0.5 * 1)
    assert reward("<think>t</think><answer>4</answer>", {"answer": "4"}) == pytest.approx(1.5)
    with pytest.raises(ConfigError, match="'abc'"):
        parse_reward_spec("math=abc")
    with pytest.raises(ConfigError, match="unique"):
        WeightedReward("math=1,math=2")
    with pytest.raises(ConfigError, match="names no reward"):
        parse_reward_spec(" , ")
