"""KL estimators, KL-shaped rewards and the log-prob helpers, by hand."""

from __future__ import annotations

import math

import pytest
import torch

from megalith.common.errors import ConfigError
from megalith_chat.algorithms import (
    kl_estimate,
    kl_shaped_rewards,
    masked_mean,
    sequence_logprobs,
    token_logprobs,
)


def test_kl_estimators_by_hand() -> None:
    # pi = 0.5, pi_ref = 0.25: l = log(0.25 / 0.5) = -log 2
    lp, ref = torch.tensor([[math.log(0.5)]]), torch.tensor([[math.log(0.25)]])
    log_ratio = math.log(0.5)
    assert float(kl_estimate(lp, ref, "k1")) == pytest.approx(-log_ratio)
    assert float(kl_estimate(lp, ref, "k2")) == pytest.approx(0.5 * log_ratio**2)
    assert float(kl_estimate(lp, ref, "k3")) == pytest.approx((0.5 - 1) - log_ratio)


def test_k1_and_k3_are_unbiased_under_the_policy() -> None:
    # E_{y~p}[k] over a full categorical distribution must equal KL(p || q) = sum p log(p/q)
    p, q = [0.5, 0.25, 0.25], [0.25, 0.25, 0.5]
    exact = sum(pi * math.log(pi / qi) for pi, qi in zip(p, q))
    lp = torch.tensor([[math.log(x) for x in p]])
    ref = torch.tensor([[math.log(x) for x in q]])
    weights = torch.tensor(p)
    for estimator in ("k1", "k3"):
        expectation = float((kl_estimate(lp, ref, estimator)[0] * weights).sum())  # type: ignore[arg-type]
        assert expectation == pytest.approx(exact, abs=1e-6)


def test_k3_gradient_is_one_minus_ratio() -> None:
    # d k3 / d logp = d/dlogp [exp(ref - logp) - 1 - ref + logp] = 1 - exp(ref - logp)
    lp = torch.tensor([[math.log(0.5)]], requires_grad=True)
    kl_estimate(lp, torch.tensor([[math.log(0.25)]]), "k3").sum().backward()
    assert lp.grad is not None
    assert float(lp.grad) == pytest.approx(1 - 0.5)


def test_unknown_estimator_rejected() -> None:
    with pytest.raises(ConfigError, match="'k4'"):
        kl_estimate(torch.zeros(1, 1), torch.zeros(1, 1), "k4")  # type: ignore[arg-type]


def test_kl_shaped_rewards_put_score_on_last_token() -> None:
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.5, 0.5, 0.5], [1.0, 1.0, 1.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]])
    out = kl_shaped_rewards(torch.tensor([2.0, 1.0, 7.0]), kl, mask, beta=0.5)
    expected = [[-0.05, -0.1 + 2.0, 0.0], [-0.25, -0.25, -0.25 + 1.0], [0.0, 0.0, 0.0]]
    for row, exp_row in zip(out.tolist(), expected):
        assert row == pytest.approx(exp_row)
    assert not out.requires_grad


def test_token_logprobs_by_hand() -> None:
    # logits [0, log 3] -> softmax [1/4, 3/4]
    logits = torch.tensor([[[0.0, math.log(3.0)], [0.0, math.log(3.0)], [5.0, 5.0]]])
    labels = torch.tensor([[1, 0, -100]])
    out = token_logprobs(logits, labels)
    assert out.tolist()[0] == pytest.approx([math.log(0.75), math.log(0.25), 0.0])


def test_token_logprobs_shape_errors() -> None:
    with pytest.raises(ConfigError, match=r"\(1, 3\)"):
        token_logprobs(torch.zeros(1, 2, 4), torch.zeros(1, 3, dtype=torch.long))


def test_sequence_logprobs_and_masked_mean() -> None:
    lp = torch.tensor([[-1.0, -2.0, -9.0], [-3.0, -9.0, -9.0], [-1.0, -1.0, -1.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
    assert sequence_logprobs(lp, mask).tolist() == [-3.0, -3.0, 0.0]
    assert sequence_logprobs(lp, mask, average=True).tolist() == [-1.5, -3.0, 0.0]
    assert float(masked_mean(lp, mask)) == pytest.approx(-6.0 / 3)
    with pytest.raises(ConfigError, match="same shape"):
        masked_mean(lp, mask[:, :2])
