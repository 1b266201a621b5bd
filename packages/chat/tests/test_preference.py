"""DPO/IPO, SimPO, ORPO, KTO and Bradley-Terry losses against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from megalith.common.errors import ConfigError
from megalith_chat.algorithms import (
    bradley_terry_loss,
    dpo_loss,
    kto_loss,
    kto_reference_point,
    orpo_loss,
    simpo_loss,
)


def _t(*values: float) -> torch.Tensor:
    return torch.tensor(values)


def _softplus(x: float) -> float:
    """-log sigmoid(-x) = log(1 + e^x)."""
    return math.log1p(math.exp(x))


def _sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def test_dpo_sigmoid_by_hand_with_gradient() -> None:
    # h = (-1 - -1.5) - (-2 - -1.5) = 1; beta 0.5 -> L = -log sigma(0.5) = log(1 + e^-0.5)
    pc = _t(-1.0).requires_grad_()
    out = dpo_loss(pc, _t(-2.0), _t(-1.5), _t(-1.5), beta=0.5)
    assert out.loss.item() == pytest.approx(_softplus(-0.5))
    assert float(out.chosen_rewards) == pytest.approx(0.25)
    assert float(out.rejected_rewards) == pytest.approx(-0.25)
    assert out.reward_accuracy == 1.0
    out.loss.backward()
    assert pc.grad is not None
    # dL/dpc = -beta * sigma(-beta h)
    assert float(pc.grad) == pytest.approx(-0.5 * _sigmoid(-0.5))


def test_dpo_label_smoothing_and_ipo() -> None:
    out = dpo_loss(_t(-1.0), _t(-2.0), _t(-1.5), _t(-1.5), beta=0.5, label_smoothing=0.1)
    assert float(out.loss) == pytest.approx(0.9 * _softplus(-0.5) + 0.1 * _softplus(0.5))
    # IPO: (h - 1/(2 beta))^2 with h = 1, beta = 0.25 -> (1 - 2)^2 = 1
    assert float(
        dpo_loss(_t(-1.0), _t(-2.0), _t(-1.5), _t(-1.5), 0.25, loss_type="ipo").loss
    ) == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"beta": 0.0}, "beta"), ({"label_smoothing": 0.5}, "0.5"), ({"loss_type": "hinge"}, "hinge")],
)
def test_dpo_rejects_bad_config(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        dpo_loss(_t(-1.0), _t(-2.0), _t(-1.5), _t(-1.5), **kwargs)  # type: ignore[arg-type]


def test_simpo_by_hand() -> None:
    # z = 2 * (-0.5 - -1.0) - 0.5 = 0.5 -> L = log(1 + e^-0.5)
    out = simpo_loss(_t(-0.5), _t(-1.0), beta=2.0, gamma=0.5)
    assert float(out.loss) == pytest.approx(_softplus(-0.5))
    assert float(out.chosen_rewards) == pytest.approx(-1.0)


def test_orpo_by_hand() -> None:
    # chosen P = 0.5 -> odds 1, log-odds 0; rejected P = 0.2 -> odds 0.25
    # L = -log 0.5 - 0.1 log sigma(0 - log 0.25) = log 2 + 0.1 log(1 + 1/4)
    out = orpo_loss(_t(math.log(0.5)), _t(math.log(0.2)), lam=0.1)
    assert float(out.loss) == pytest.approx(math.log(2) + 0.1 * math.log(1.25))
    assert float(out.rejected_rewards) == pytest.approx(math.log(0.25))
    with pytest.raises(ConfigError, match="< 0"):
        orpo_loss(_t(0.0), _t(-1.0))


def test_kto_by_hand() -> None:
    # r = -1 - -2 = 1, z0 = 0.5, beta = 1
    out = kto_loss(
        _t(-1.0, -1.0), _t(-2.0, -2.0), torch.tensor([True, False]), 0.5, beta=1.0, desirable_weight=2.0
    )
    assert out.losses.tolist() == pytest.approx([2 * (1 - _sigmoid(0.5)), 1 - _sigmoid(-0.5)])
    assert out.chosen_rewards.tolist() == [1.0, 0.0]
    assert out.rejected_rewards.tolist() == [0.0, 1.0]
    with pytest.raises(ConfigError, match="bool"):
        kto_loss(_t(-1.0), _t(-2.0), torch.tensor([1]), 0.0)


def test_kto_reference_point_is_clamped_mean() -> None:
    assert float(kto_reference_point(_t(-1.0, -1.0), _t(-2.0, -2.5))) == pytest.approx(1.25)
    assert float(kto_reference_point(_t(-3.0, -1.0), _t(-2.0, -2.0))) == 0.0  # mean 0
    assert float(kto_reference_point(_t(-3.0), _t(-2.0))) == 0.0  # negative -> 0


def test_bradley_terry_by_hand() -> None:
    assert float(bradley_terry_loss(_t(2.0), _t(1.0)).loss) == pytest.approx(_softplus(-1.0))
    assert float(bradley_terry_loss(_t(2.0), _t(1.0), margin=1.0).loss) == pytest.approx(math.log(2))
    scores = _t(0.0, 3.0).requires_grad_()
    out = bradley_terry_loss(scores[:1], scores[1:])
    out.loss.backward()
    assert scores.grad is not None
    # dL/ds_w = -sigma(-(s_w - s_l)) = -sigma(3); dL/ds_l = +sigma(3)
    assert scores.grad.tolist() == pytest.approx([-_sigmoid(3.0), _sigmoid(3.0)])
    assert out.reward_accuracy == 0.0
