"""Advantage estimators against values worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megalith.common.errors import ConfigError
from megalith_chat.algorithms import (
    discounted_returns,
    dr_grpo_advantages,
    gae_advantages,
    grpo_advantages,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
)


def _close(actual: torch.Tensor, expected: list[float], tol: float = 1e-5) -> None:
    assert actual.tolist() == pytest.approx(expected, abs=tol)


def test_grpo_two_groups_by_hand() -> None:
    # group 1: [1, 0, 0, 1]: mean 0.5, sample var = 4 * 0.25 / 3, std = sqrt(1/3)
    std1 = math.sqrt(1 / 3)
    # group 2: [1, 2, 3]... use size-4 groups: [1, 2, 3, 6]: mean 3, var = (4+1+0+9)/3
    std2 = math.sqrt(14 / 3)
    eps = 1e-6
    adv = grpo_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 2.0, 3.0, 6.0]), group_size=4, eps=eps)
    expected = [0.5 / (std1 + eps), -0.5 / (std1 + eps), -0.5 / (std1 + eps), 0.5 / (std1 + eps)]
    expected += [-2 / (std2 + eps), -1 / (std2 + eps), 0.0, 3 / (std2 + eps)]
    _close(adv, expected)


def test_grpo_zero_variance_group_is_exactly_zero_no_nan() -> None:
    # 0.1 is not exactly representable: a naive (r - mean) / (std + eps) gives ~1e-3 noise here
    adv = grpo_advantages(torch.tensor([0.1, 0.1, 0.1, 0.7, 0.7, 0.7]), group_size=3)
    assert adv.tolist() == [0.0] * 6
    assert not torch.isnan(adv).any()


def test_grpo_one_sample_per_group_gives_zero_not_nan() -> None:
    adv = grpo_advantages(torch.tensor([3.0, -1.0, 0.5]), group_size=1)
    assert adv.tolist() == [0.0, 0.0, 0.0]


def test_dr_grpo_no_std_division() -> None:
    _close(dr_grpo_advantages(torch.tensor([1.0, 2.0, 6.0, 4.0, 4.0, 4.0]), 3), [-2, -1, 3, 0, 0, 0])
    assert dr_grpo_advantages(torch.tensor([5.0, 7.0]), 1).tolist() == [0.0, 0.0]


def test_rloo_leave_one_out_baseline() -> None:
    # [1, 2, 6]: 1 - (2+6)/2 = -3; 2 - (1+6)/2 = -1.5; 6 - (1+2)/2 = 4.5
    _close(rloo_advantages(torch.tensor([1.0, 2.0, 6.0]), 3), [-3.0, -1.5, 4.5])
    assert rloo_advantages(torch.tensor([0.3, 0.3]), 2).tolist() == [0.0, 0.0]


def test_rloo_rejects_single_sample_groups() -> None:
    with pytest.raises(ConfigError, match="group_size=1"):
        rloo_advantages(torch.tensor([1.0, 2.0]), 1)


def test_reinforce_pp_baseline_group_mean_then_batch_norm() -> None:
    # groups [1, 0] and [3, 3]: centred [0.5, -0.5, 0, 0]; batch mean 0, population std sqrt(0.125)
    std = math.sqrt((0.25 + 0.25) / 4)
    eps = 1e-6
    adv = reinforce_pp_baseline_advantages(torch.tensor([1.0, 0.0, 3.0, 3.0]), 2, eps=eps)
    _close(adv, [0.5 / (std + eps), -0.5 / (std + eps), 0.0, 0.0])


def test_reinforce_pp_baseline_all_constant_is_zero() -> None:
    assert reinforce_pp_baseline_advantages(torch.tensor([1.0, 1.0, 2.0, 2.0]), 2).tolist() == [0.0] * 4


@pytest.mark.parametrize("bad", [0, 3, -1])
def test_group_size_must_divide_batch(bad: int) -> None:
    with pytest.raises(ConfigError, match=str(bad)):
        grpo_advantages(torch.zeros(4), bad)


def test_rewards_must_be_one_dimensional() -> None:
    with pytest.raises(ConfigError, match=r"\(2, 2\)"):
        grpo_advantages(torch.zeros(2, 2), 2)


def test_discounted_returns_by_hand() -> None:
    # gamma 0.5, rewards [1, 2, (3 masked)]: G1 = 2, G0 = 1 + 0.5 * 2 = 2
    out = discounted_returns(torch.tensor([[1.0, 2.0, 3.0]]), torch.tensor([[1, 1, 0]]), gamma=0.5)
    _close(out[0], [2.0, 2.0, 0.0])


def test_reinforce_pp_whitens_returns_over_masked_tokens() -> None:
    # returns with gamma 1: row0 [1, 1], row1 [3, (pad)] -> values {1, 1, 3}: mean 5/3, pop var 8/9
    out = reinforce_pp_advantages(
        torch.tensor([[0.0, 1.0], [3.0, 9.0]]), torch.tensor([[1, 1], [1, 0]]), eps=0.0
    )
    mean, std = 5 / 3, math.sqrt(8 / 9)
    _close(out.flatten(), [(1 - mean) / std, (1 - mean) / std, (3 - mean) / std, 0.0])


def test_gae_by_hand() -> None:
    # gamma 1, lambda 0.5, r = [0, 0, 1], V = [0.5, 0.6, 0.7]; V after the end = 0
    # delta = [0 + 0.6 - 0.5, 0 + 0.7 - 0.6, 1 + 0 - 0.7] = [0.1, 0.1, 0.3]
    # A2 = 0.3, A1 = 0.1 + 0.5*0.3 = 0.25, A0 = 0.1 + 0.5*0.25 = 0.225
    adv, ret = gae_advantages(
        torch.tensor([[0.0, 0.0, 1.0]]), torch.tensor([[0.5, 0.6, 0.7]]), torch.ones(1, 3), gamma=1.0, lam=0.5
    )
    _close(adv[0], [0.225, 0.25, 0.3])
    _close(ret[0], [0.725, 0.85, 1.0])


def test_gae_padding_ends_the_episode() -> None:
    # gamma 0.9, lambda 1; the padded value 9 must not leak: A1 = 1 - 0.7, A0 = 0.9*0.7 - 0.5 + 0.9*A1
    adv, _ = gae_advantages(
        torch.tensor([[0.0, 1.0, 5.0]]), torch.tensor([[0.5, 0.7, 9.0]]), torch.tensor([[1, 1, 0]]), 0.9, 1.0
    )
    _close(adv[0], [0.9 * 0.7 - 0.5 + 0.9 * 0.3, 0.3, 0.0])


group_rewards = st.lists(
    st.lists(st.floats(-10, 10, allow_nan=False, width=32), min_size=4, max_size=4), min_size=1, max_size=5
)


@settings(max_examples=60, deadline=None)
@given(group_rewards)
def test_grpo_zero_mean_and_unit_std_per_group(groups: list[list[float]]) -> None:
    adv = grpo_advantages(torch.tensor(groups).flatten(), 4).reshape(-1, 4)
    assert not torch.isnan(adv).any()
    for row, rewards in zip(adv, groups):
        assert float(row.sum()) == pytest.approx(0.0, abs=1e-4)
        spread = max(rewards) - min(rewards)
        if spread > 1e-2:  # the std of the advantages is std / (std + eps) ~= 1
            assert float(row.std()) == pytest.approx(1.0, abs=1e-3)


@settings(max_examples=60, deadline=None)
@given(group_rewards, st.floats(-100, 100, allow_nan=False))
def test_group_advantages_invariant_to_reward_shift(groups: list[list[float]], shift: float) -> None:
    rewards = torch.tensor(groups, dtype=torch.float64).flatten()
    for fn in (dr_grpo_advantages, rloo_advantages):
        base = fn(rewards, 4)
        shifted = fn(rewards + shift, 4)
        assert torch.allclose(base, shifted, atol=1e-3)
        assert torch.allclose(base.reshape(-1, 4).sum(dim=1), torch.zeros(len(groups)), atol=1e-3)
