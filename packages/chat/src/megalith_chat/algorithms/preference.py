"""Offline preference losses (DPO, IPO, SimPO, ORPO, KTO) and the Bradley-Terry reward-model loss.

Inputs are *sequence* log-probabilities ``[batch]`` of the response given the prompt
(:func:`megalith_chat.algorithms.logprobs.sequence_logprobs`): summed over response tokens for
DPO/IPO/KTO, length-averaged for SimPO/ORPO (as their papers prescribe). Every loss returns a
:class:`PreferenceLossOutput` with per-example losses; ``.loss`` is their mean.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from megalith.common.errors import ConfigError
from megalith_chat.algorithms.logprobs import _check_same_shape


@dataclass(frozen=True)
class PreferenceLossOutput:
    """Per-example ``losses [batch]`` and the implicit rewards of chosen/rejected (detached)."""

    losses: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor

    @property
    def loss(self) -> torch.Tensor:
        return self.losses.mean()

    @property
    def reward_accuracy(self) -> float:
        return float((self.chosen_rewards > self.rejected_rewards).float().mean())


def _check_beta(beta: float) -> None:
    if not beta > 0:  # NaN fails too
        raise ConfigError(f"beta must be > 0, got {beta}")


def _check_smoothing(label_smoothing: float) -> None:
    if not 0.0 <= label_smoothing < 0.5:
        raise ConfigError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    loss_type: Literal["sigmoid", "ipo"] = "sigmoid",
) -> PreferenceLossOutput:
    """Direct Preference Optimisation (Rafailov et al. 2023) and its IPO variant.

    With ``h = (log pi(y_w) - log pi_ref(y_w)) - (log pi(y_l) - log pi_ref(y_l))``:

    * ``sigmoid``: ``L = -(1 - e) log sigma(beta h) - e log sigma(-beta h)``; ``e = label_smoothing``
      is the conservative DPO of Mitchell (2023) for noisy labels (``e = 0`` is plain DPO).
    * ``ipo`` (Azar et al. 2023): ``L = (h - 1/(2 beta))^2`` -- regresses the margin to a finite
      target instead of pushing it to infinity.

    Implicit rewards: ``beta * (log pi - log pi_ref)``. Shapes: four ``[batch]`` -> ``[batch]``.
    """
    _check_same_shape(
        policy_chosen=policy_chosen,
        policy_rejected=policy_rejected,
        ref_chosen=ref_chosen,
        ref_rejected=ref_rejected,
    )
    _check_beta(beta)
    _check_smoothing(label_smoothing)
    chosen_logratio = policy_chosen - ref_chosen
    rejected_logratio = policy_rejected - ref_rejected
    h = chosen_logratio - rejected_logratio
    if loss_type == "sigmoid":
        losses = -(1 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)
    elif loss_type == "ipo":
        losses = (h - 1.0 / (2.0 * beta)).pow(2)
    else:
        raise ConfigError(f"unknown DPO loss_type {loss_type!r}; expected 'sigmoid' or 'ipo'")
    return PreferenceLossOutput(
        losses, (beta * chosen_logratio).detach(), (beta * rejected_logratio).detach()
    )


def simpo_loss(
    chosen_avg_logps: torch.Tensor,
    rejected_avg_logps: torch.Tensor,
    beta: float = 2.0,
    gamma: float = 0.5,
    label_smoothing: float = 0.0,
) -> PreferenceLossOutput:
    """SimPO (Meng et al. 2024): reference-free, length-normalised, with a target margin.

    ``L = -log sigma(beta * avg_logp(y_w) - beta * avg_logp(y_l) - gamma)`` where
    ``avg_logp(y) = (1/|y|) sum_t log pi(y_t)`` and ``gamma`` is the reward margin (label smoothing
    as in conservative DPO). Implicit rewards: ``beta * avg_logp``.
    """
    _check_same_shape(chosen_avg_logps=chosen_avg_logps, rejected_avg_logps=rejected_avg_logps)
    _check_beta(beta)
    _check_smoothing(label_smoothing)
    z = beta * (chosen_avg_logps - rejected_avg_logps) - gamma
    losses = -(1 - label_smoothing) * F.logsigmoid(z) - label_smoothing * F.logsigmoid(-z)
    return PreferenceLossOutput(
        losses, (beta * chosen_avg_logps).detach(), (beta * rejected_avg_logps).detach()
    )


def orpo_loss(
    chosen_avg_logps: torch.Tensor, rejected_avg_logps: torch.Tensor, lam: float = 0.1
) -> PreferenceLossOutput:
    """ORPO (Hong et al. 2024): SFT on the chosen response plus an odds-ratio penalty, no reference.

    With ``P(y) = exp(avg_logp(y))`` and ``odds(y) = P / (1 - P)``:
    ``L = -avg_logp(y_w) - lam * log sigma(log odds(y_w) - log odds(y_l))``, and
    ``log odds = avg_logp - log(1 - exp(avg_logp))`` (computed with ``log1p(-exp)``).
    Implicit rewards: the log-odds of each response. Inputs must be ``< 0`` (probabilities < 1).
    """
    _check_same_shape(chosen_avg_logps=chosen_avg_logps, rejected_avg_logps=rejected_avg_logps)
    if not lam >= 0:  # NaN fails too
        raise ConfigError(f"ORPO lambda must be >= 0, got {lam}")
    if bool((chosen_avg_logps >= 0).any() or (rejected_avg_logps >= 0).any()):
        raise ConfigError("ORPO needs average log-probs < 0 (a probability of 1 has infinite odds)")
    log_odds_w = chosen_avg_logps - torch.log1p(-torch.exp(chosen_avg_logps))
    log_odds_l = rejected_avg_logps - torch.log1p(-torch.exp(rejected_avg_logps))
    losses = -chosen_avg_logps - lam * F.logsigmoid(log_odds_w - log_odds_l)
    return PreferenceLossOutput(losses, log_odds_w.detach(), log_odds_l.detach())


def kto_reference_point(policy_kl_logps: torch.Tensor, ref_kl_logps: torch.Tensor) -> torch.Tensor:
    """KTO's reference point ``z0 = max(0, mean(log pi(y'|x) - log pi_ref(y'|x)))``, detached.

    ``y'`` are *mismatched* completions (another prompt's response), giving a biased but cheap
    estimate of ``KL(pi || pi_ref)`` (Ethayarajh et al. 2024, Sec. 4).
    """
    _check_same_shape(policy_kl_logps=policy_kl_logps, ref_kl_logps=ref_kl_logps)
    return (policy_kl_logps - ref_kl_logps).mean().clamp(min=0.0).detach()


def kto_loss(
    policy_logps: torch.Tensor,
    ref_logps: torch.Tensor,
    desirable: torch.Tensor,
    reference_point: torch.Tensor | float,
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> PreferenceLossOutput:
    """Kahneman-Tversky Optimisation (Ethayarajh et al. 2024) on unpaired good/bad examples.

    With ``r = log pi(y|x) - log pi_ref(y|x)`` and reference point ``z0``
    (:func:`kto_reference_point`):
    desirable ``L = lambda_D (1 - sigma(beta (r - z0)))``; undesirable
    ``L = lambda_U (1 - sigma(beta (z0 - r)))``.
    ``chosen_rewards`` holds ``beta r`` of desirable examples (0 elsewhere), ``rejected_rewards``
    that of undesirable ones. Shapes: ``[batch]`` (``desirable`` bool) -> ``[batch]``.
    """
    _check_same_shape(policy_logps=policy_logps, ref_logps=ref_logps, desirable=desirable)
    _check_beta(beta)
    if desirable.dtype != torch.bool:
        raise ConfigError(f"desirable must be a bool tensor, got {desirable.dtype}")
    z0 = torch.as_tensor(reference_point, dtype=policy_logps.dtype, device=policy_logps.device).detach()
    r = policy_logps - ref_logps
    good = desirable_weight * (1 - torch.sigmoid(beta * (r - z0)))
    bad = undesirable_weight * (1 - torch.sigmoid(beta * (z0 - r)))
    losses = torch.where(desirable, good, bad)
    rewards = (beta * r).detach()
    zeros = torch.zeros_like(rewards)
    return PreferenceLossOutput(
        losses, torch.where(desirable, rewards, zeros), torch.where(desirable, zeros, rewards)
    )


def bradley_terry_loss(
    chosen_scores: torch.Tensor, rejected_scores: torch.Tensor, margin: torch.Tensor | float = 0.0
) -> PreferenceLossOutput:
    """Pairwise reward-model loss under the Bradley-Terry model (Ouyang et al. 2022, InstructGPT).

    ``P(y_w > y_l) = sigma(s_w - s_l)``, so ``L = -log sigma(s_w - s_l - m)`` with an optional
    margin ``m`` (Llama 2's margin loss, Touvron et al. 2023). Scores are the RM's scalar outputs.
    """
    _check_same_shape(chosen_scores=chosen_scores, rejected_scores=rejected_scores)
    losses = -F.logsigmoid(chosen_scores - rejected_scores - margin)
    return PreferenceLossOutput(losses, chosen_scores.detach(), rejected_scores.detach())
