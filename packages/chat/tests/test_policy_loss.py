"""PPO-clip (asymmetric, dual clip), TIS, value loss, and the combined policy loss, by hand."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from megalith.common.errors import ConfigError
from megalith_chat.algorithms import (
    PolicyLossConfig,
    clipped_value_loss,
    policy_loss,
    ppo_clip_token_losses,
    truncated_is_weights,
)


def _loss_and_grad(ratio: float, adv: float, **kwargs: float | None) -> tuple[float, float, bool]:
    """One token with ``pi/pi_old = ratio``; returns (loss, dloss/dlogp, clipped flag)."""
    logp = torch.tensor([[math.log(ratio)]], requires_grad=True)
    out = ppo_clip_token_losses(logp, torch.zeros(1, 1), torch.tensor([adv]), **kwargs)  # type: ignore[arg-type]
    out.token_losses.sum().backward()
    assert logp.grad is not None
    return out.token_losses.item(), logp.grad.item(), bool(out.clipped)


@pytest.mark.parametrize(
    ("ratio", "adv", "loss", "grad", "clipped"),
    [
        # inside the trust region: L = -rho A, dL/dlogp = -rho A
        (1.1, 2.0, -2.2, -2.2, False),
        # A > 0 and rho > 1 + eps: L = -(1.2) A, gradient exactly zero
        (1.5, 2.0, -2.4, 0.0, True),
        # A < 0 and rho < 1 - eps: L = -(0.8) A = 0.8, gradient zero
        (0.5, -1.0, 0.8, 0.0, True),
        # A > 0 and rho < 1 - eps: the unclipped (pessimistic) branch keeps its gradient
        (0.5, 1.0, -0.5, -0.5, False),
        # A < 0 and rho > 1 + eps: unclipped branch, L = -rho A = 2, grad = 2
        (2.0, -1.0, 2.0, 2.0, False),
    ],
)
def test_ppo_clip_symmetric(ratio: float, adv: float, loss: float, grad: float, clipped: bool) -> None:
    got = _loss_and_grad(ratio, adv, eps_low=0.2)
    assert got[0] == pytest.approx(loss, abs=1e-5)
    assert got[1] == pytest.approx(grad, abs=1e-5)
    assert got[2] is clipped


def test_clip_higher_lets_positive_tokens_grow_further() -> None:
    # rho = 1.25: clipped at 1.2 with eps_high = eps_low = 0.2, free with DAPO eps_high = 0.28
    assert _loss_and_grad(1.25, 1.0, eps_low=0.2)[:2] == pytest.approx((-1.2, 0.0), abs=1e-5)
    assert _loss_and_grad(1.25, 1.0, eps_low=0.2, eps_high=0.28)[:2] == pytest.approx(
        (-1.25, -1.25), abs=1e-5
    )
    # the low side still uses eps_low: rho = 0.7 < 0.8 with A < 0 -> L = 0.8 * 1, zero grad
    assert _loss_and_grad(0.7, -1.0, eps_low=0.2, eps_high=0.28)[:2] == pytest.approx((0.8, 0.0), abs=1e-5)


def test_dual_clip_bounds_negative_advantage_loss() -> None:
    # A = -1, rho = 5: plain PPO gives L = 5 with gradient 5; dual clip c = 3 caps L at 3, zero grad
    assert _loss_and_grad(5.0, -1.0, eps_low=0.2)[:2] == pytest.approx((5.0, 5.0), abs=1e-4)
    loss, grad, clipped = _loss_and_grad(5.0, -1.0, eps_low=0.2, dual_clip=3.0)
    assert (loss, grad, clipped) == (pytest.approx(3.0), pytest.approx(0.0), True)
    # below c the dual clip is inactive
    assert _loss_and_grad(2.0, -1.0, eps_low=0.2, dual_clip=3.0)[:2] == pytest.approx((2.0, 2.0), abs=1e-5)
    # positive advantages are never dual-clipped
    assert _loss_and_grad(5.0, 1.0, eps_low=0.2, dual_clip=3.0)[:2] == pytest.approx((-1.2, 0.0), abs=1e-5)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"eps_low": 1.0}, "eps_low=1.0"), ({"eps_high": -0.1}, "eps_high=-0.1"), ({"dual_clip": 0.9}, "0.9")],
)
def test_ppo_clip_rejects_bad_config(kwargs: dict[str, float], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        ppo_clip_token_losses(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1), **kwargs)


def test_advantage_shape_is_checked() -> None:
    with pytest.raises(ConfigError, match=r"\(3,\)"):
        ppo_clip_token_losses(torch.zeros(2, 2), torch.zeros(2, 2), torch.ones(3))


def test_tis_weights_are_truncated_and_detached() -> None:
    old = torch.tensor([[math.log(0.6), math.log(0.3)]], requires_grad=True)
    rollout = torch.tensor([[math.log(0.2), math.log(0.6)]])
    w = truncated_is_weights(old, rollout, cap=2.0)
    # 0.6 / 0.2 = 3 -> capped to 2; 0.3 / 0.6 = 0.5
    assert w.tolist()[0] == pytest.approx([2.0, 0.5])
    assert not w.requires_grad
    with pytest.raises(ConfigError, match="0"):
        truncated_is_weights(old, rollout, cap=0.0)


def test_clipped_value_loss_by_hand() -> None:
    # V = 1.0, V_old = 0.5, R = 2: unclipped (1-2)^2 = 1; clipped V = 0.7 -> 1.69; 0.5 * max = 0.845
    out = clipped_value_loss(torch.tensor([1.0]), torch.tensor([0.5]), torch.tensor([2.0]), clip_eps=0.2)
    assert float(out) == pytest.approx(0.845)


def test_policy_loss_with_tis_and_kl_in_loss() -> None:
    # two tokens, rho = 1, A = 1 -> clip loss -1 each
    # TIS: old/rollout = exp(0 - log 0.5) = 2 -> cap 1.5 on token 0, 1 on token 1
    # k1 KL = logp - ref = [0 - (-0.5), 0 - 0] = [0.5, 0]; kl_coef 0.1
    # tokens: [-1 * 1.5 + 0.05, -1 * 1 + 0] = [-1.45, -1]; token-mean = -1.225
    config = PolicyLossConfig(kl_coef=0.1, kl_estimator="k1", tis_cap=1.5)
    logp = torch.zeros(1, 2, requires_grad=True)
    result = policy_loss(
        config,
        logp,
        torch.zeros(1, 2),
        torch.tensor([1.0]),
        torch.ones(1, 2),
        ref_logprobs=torch.tensor([[-0.5, 0.0]]),
        rollout_logprobs=torch.tensor([[math.log(0.5), 0.0]]),
    )
    assert result.loss.item() == pytest.approx(-1.225)
    assert result.metrics["kl"] == pytest.approx(0.25)
    assert result.metrics["tis_weight_mean"] == pytest.approx(1.25)
    assert result.metrics["clip_fraction"] == 0.0
    result.loss.backward()
    assert logp.grad is not None
    # d/dlogp of mean(-w rho A + 0.1 (logp - ref)) = (-w + 0.1) / 2
    assert logp.grad.tolist()[0] == pytest.approx([(-1.5 + 0.1) / 2, (-1.0 + 0.1) / 2])


def test_policy_loss_config_validates() -> None:
    with pytest.raises(ConfigError, match="token-max"):
        PolicyLossConfig(agg_mode="token-max")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="k9"):
        PolicyLossConfig(kl_estimator="k9")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="ref_logprobs"):
        policy_loss(
            PolicyLossConfig(kl_coef=0.1),
            torch.zeros(1, 1),
            torch.zeros(1, 1),
            torch.ones(1),
            torch.ones(1, 1),
        )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"eps_low": 1.5}, "eps_low=1.5"),
        ({"eps_low": -0.1}, "eps_low=-0.1"),
        ({"eps_high": -1.0}, "eps_high=-1.0"),
        ({"dual_clip": 0.5}, "dual_clip=0.5"),
    ],
)
def test_policy_loss_config_checks_clip_ranges(kwargs: dict[str, float], match: str) -> None:
    """Bad clip ranges fail when the config is built (before any run starts), not in the first step."""
    with pytest.raises(ConfigError, match=match):
        PolicyLossConfig(**kwargs)


@settings(max_examples=80, deadline=None)
@given(
    st.floats(0.05, 8.0),
    st.floats(-3.0, 3.0).filter(lambda a: abs(a) > 1e-3),
    st.floats(0.05, 0.4),
    st.floats(0.0, 0.3),
    st.sampled_from([None, 2.0, 4.0]),
)
def test_gradient_is_zero_exactly_where_a_clip_is_active(
    ratio: float, adv: float, eps_low: float, extra_high: float, dual: float | None
) -> None:
    eps_high = eps_low + extra_high
    bounds = [1 - eps_low, 1 + eps_high] + ([dual] if dual else [])
    assume(all(abs(ratio - b) > 1e-3 for b in bounds))
    loss, grad, clipped = _loss_and_grad(ratio, adv, eps_low=eps_low, eps_high=eps_high, dual_clip=dual)
    if clipped:
        assert grad == 0.0
    else:  # unclipped: L = -rho A, so dL/dlogp = -rho A = L
        assert grad == pytest.approx(-ratio * adv, rel=1e-4)
        assert loss == pytest.approx(-ratio * adv, rel=1e-4)
    if dual is None:  # the clipped objective is a pessimistic bound: L >= -rho A
        assert loss >= -ratio * adv - 1e-5
    elif adv < 0:  # dual clip caps the loss of negative-advantage tokens at -c A
        assert loss <= -dual * adv + 1e-5


def test_nan_settings_are_refused() -> None:
    """`x < 0` checks let NaN through (every comparison with NaN is false); each of these did."""
    from megalith.common.errors import ConfigError
    from megalith_chat.algorithms.policy_loss import PolicyLossConfig, check_clip
    from megalith_chat.algorithms.preference import dpo_loss, orpo_loss
    from megalith_chat.rollout.generation import SamplingConfig
    from megalith_chat.trainer.grpo import LearnerConfig

    nan = float("nan")
    logps = torch.full((2,), -1.0)
    cases = [
        (lambda: check_clip(0.2, nan, None), "eps_high"),
        (lambda: check_clip(0.2, None, nan), "dual_clip"),
        (lambda: PolicyLossConfig(kl_coef=nan), "kl_coef"),
        (lambda: PolicyLossConfig(tis_cap=nan), "tis_cap"),
        (lambda: LearnerConfig(max_grad_norm=nan), "max_grad_norm"),
        (lambda: SamplingConfig(temperature=nan), "temperature"),
        (lambda: dpo_loss(logps, logps, logps, logps, beta=nan), "beta"),
        (lambda: orpo_loss(logps, logps, lam=nan), "lambda"),
    ]
    for make, name in cases:
        with pytest.raises(ConfigError, match=name):
            make()
