"""Per-token KL estimators between the policy and a reference policy.

Schulman (2020), "Approximating KL Divergence" (joschu.net blog). With samples ``y ~ pi`` and
the log ratio ``l_t = log pi_ref(y_t) - log pi(y_t)``, the estimators of ``KL(pi || pi_ref)`` are

* ``k1 = -l``                      unbiased, high variance, can be negative;
* ``k2 = l^2 / 2``                 biased, low variance, always >= 0;
* ``k3 = (exp(l) - 1) - l``        unbiased, low variance, always >= 0.

They can be used *in the reward* (detached; :func:`kl_shaped_rewards`, as in PPO-RLHF and
REINFORCE++) or *in the loss* (with gradient, added as ``beta * aggregate(kl)``, as in GRPO).
"""

from __future__ import annotations

from typing import Literal

import torch

from megalith.common.errors import ConfigError
from megalith_chat.algorithms.logprobs import _check_same_shape

KLEstimator = Literal["k1", "k2", "k3"]


def kl_estimate(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    estimator: KLEstimator = "k3",
    clamp: float | None = 10.0,
) -> torch.Tensor:
    """Per-token KL estimate ``k1``/``k2``/``k3`` (see module docstring).

    ``clamp`` bounds the log ratio to ``[-clamp, clamp]`` before ``exp`` so one far-off token
    cannot overflow ``k3``; ``None`` disables it. Gradients flow into ``logprobs`` (and
    ``ref_logprobs`` if it requires grad; it normally does not).

    Shapes: ``[batch, seq]`` -> ``[batch, seq]``.
    """
    _check_same_shape(logprobs=logprobs, ref_logprobs=ref_logprobs)
    log_ratio = ref_logprobs.float() - logprobs.float()
    if clamp is not None:
        log_ratio = log_ratio.clamp(-clamp, clamp)
    if estimator == "k1":
        return -log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.pow(2)
    if estimator == "k3":
        return torch.expm1(log_ratio) - log_ratio
    raise ConfigError(f"unknown KL estimator {estimator!r}; expected 'k1', 'k2' or 'k3'")


def kl_shaped_rewards(
    scores: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor, beta: float
) -> torch.Tensor:
    """Token rewards with a KL penalty: ``r_t = -beta * kl_t`` plus the outcome score on the last token.

    ``kl`` is detached (a reward carries no gradient). The score of sequence ``b`` is added at its
    last position where ``mask`` is 1; rows with an empty mask get no score.

    Shapes: scores ``[batch]``, kl and mask ``[batch, seq]`` -> ``[batch, seq]``.
    """
    _check_same_shape(kl=kl, mask=mask)
    if scores.shape != kl.shape[:1]:
        raise ConfigError(f"scores must be [batch]={tuple(kl.shape[:1])}, got {tuple(scores.shape)}")
    m = mask.float()
    rewards = -beta * kl.detach().float() * m
    positions = torch.arange(m.shape[1], device=m.device).expand_as(m)
    last = torch.where(m > 0, positions, torch.full_like(positions, -1)).amax(dim=1)
    has_tokens = last >= 0
    rows = torch.arange(m.shape[0], device=m.device)[has_tokens]
    rewards[rows, last[has_tokens]] += scores.float()[has_tokens]
    return rewards
