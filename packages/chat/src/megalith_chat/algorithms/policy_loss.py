"""PPO-clip policy loss (with DAPO clip-higher and dual clip), PPO value loss, and truncated IS.

All per-token quantities are ``[batch, seq]``; advantages may be ``[batch]`` (sequence-level,
broadcast over tokens) or ``[batch, seq]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megalith.common.errors import ConfigError
from megalith_chat.algorithms.aggregation import AGG_MODES, AggMode, aggregate_loss
from megalith_chat.algorithms.kl import KLEstimator, kl_estimate
from megalith_chat.algorithms.logprobs import _check_same_shape, masked_mean


@dataclass(frozen=True)
class PolicyLossOutput:
    """Per-token PPO losses and diagnostics (all ``[batch, seq]``)."""

    token_losses: torch.Tensor
    ratio: torch.Tensor
    clipped: torch.Tensor  # bool: the clipped (zero-gradient) branch was taken


def _broadcast_advantages(advantages: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    if advantages.shape == like.shape:
        return advantages.float()
    if advantages.dim() == 1 and advantages.shape[0] == like.shape[0]:
        return advantages.float().unsqueeze(-1).expand_as(like)
    raise ConfigError(
        f"advantages must be [batch] or [batch, seq] = {tuple(like.shape)}, got {tuple(advantages.shape)}"
    )


def check_clip(eps_low: float, eps_high: float | None, dual_clip: float | None) -> None:
    """The clip ranges PPO-clip accepts: ``0 <= eps_low < 1``, ``eps_high >= 0``, ``dual_clip > 1``."""
    if not 0.0 <= eps_low < 1.0:
        raise ConfigError(f"need 0 <= eps_low < 1, got eps_low={eps_low}")
    if eps_high is not None and not eps_high >= 0.0:  # NaN fails too
        raise ConfigError(f"need eps_high >= 0, got eps_high={eps_high}")
    if dual_clip is not None and not dual_clip > 1.0:
        raise ConfigError(f"need dual_clip > 1, got dual_clip={dual_clip}")


def ppo_clip_token_losses(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    eps_low: float = 0.2,
    eps_high: float | None = None,
    dual_clip: float | None = None,
) -> PolicyLossOutput:
    """Clipped surrogate of PPO (Schulman et al. 2017) with asymmetric and dual clipping.

    ``rho_t = exp(logp_t - logp_old_t)`` and, per token,
    ``L_t = -min(rho_t A_t, clip(rho_t, 1 - eps_low, 1 + eps_high) A_t)``.
    ``eps_high > eps_low`` is DAPO's clip-higher (Yu et al. 2025), which lets low-probability
    tokens grow and so keeps entropy up; ``eps_high=None`` means ``eps_high = eps_low``.
    Dual clip (Ye et al. 2020) bounds the loss of negative-advantage tokens whose ratio exploded:
    for ``A_t < 0``, ``L_t = min(L_t, -c A_t)`` with ``c = dual_clip > 1``.
    Where a clip is active the token's gradient is exactly zero.
    """
    _check_same_shape(logprobs=logprobs, old_logprobs=old_logprobs)
    check_clip(eps_low, eps_high, dual_clip)
    eps_high = eps_low if eps_high is None else eps_high
    adv = _broadcast_advantages(advantages, logprobs)
    ratio = torch.exp(logprobs.float() - old_logprobs.float().detach())
    unclipped = -adv * ratio
    clipped_branch = -adv * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    losses = torch.maximum(unclipped, clipped_branch)
    clipped = clipped_branch > unclipped
    if dual_clip is not None:
        dual_bound = -adv * dual_clip
        dual_active = (adv < 0) & (losses > dual_bound)
        losses = torch.where(dual_active, dual_bound, losses)
        clipped = clipped | dual_active
    return PolicyLossOutput(token_losses=losses, ratio=ratio, clipped=clipped)


def truncated_is_weights(
    old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, cap: float = 2.0
) -> torch.Tensor:
    """Truncated importance-sampling correction for rollout/trainer mismatch (TIS).

    The inference engine that sampled the rollout computes slightly different probabilities than
    the trainer at the same weights (kernels, precision), so the PPO "old" policy is not the
    behaviour policy. Yao et al. 2025 ("Your efficient RL framework secretly brings you off-policy
    RL training") reweight each token by ``w_t = min(pi_trainer_old(y_t) / pi_rollout(y_t), C)``,
    i.e. ``min(exp(logp_old - logp_rollout), cap)``, detached. Multiply the per-token loss by it.

    Shapes: ``[batch, seq]`` -> ``[batch, seq]`` (no gradient).
    """
    _check_same_shape(old_logprobs=old_logprobs, rollout_logprobs=rollout_logprobs)
    if cap <= 0:
        raise ConfigError(f"TIS cap must be > 0, got {cap}")
    log_w = (old_logprobs.float() - rollout_logprobs.float()).detach()
    return torch.exp(log_w).clamp(max=cap)


def clipped_value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip_eps: float = 0.2
) -> torch.Tensor:
    """PPO critic loss ``0.5 * max((V - R)^2, (clip(V, V_old - eps, V_old + eps) - R)^2)`` per token."""
    _check_same_shape(values=values, old_values=old_values, returns=returns)
    clipped = old_values + (values - old_values).clamp(-clip_eps, clip_eps)
    return 0.5 * torch.maximum((values - returns).pow(2), (clipped - returns).pow(2))


@dataclass(frozen=True)
class PolicyLossConfig:
    """Everything that shapes the GRPO/PPO policy loss; validates itself.

    ``kl_coef > 0`` adds ``kl_coef * kl_estimator(pi, pi_ref)`` to every token's loss (KL in the
    loss, as in GRPO); put the KL in the reward instead with
    :func:`megalith_chat.algorithms.kl.kl_shaped_rewards` and ``kl_coef=0``.
    ``tis_cap`` enables truncated importance sampling when rollout log-probs are given.
    """

    eps_low: float = 0.2
    eps_high: float | None = None
    dual_clip: float | None = None
    kl_coef: float = 0.0
    kl_estimator: KLEstimator = "k3"
    agg_mode: AggMode = "token-mean"
    norm_constant: float | None = None
    tis_cap: float | None = None

    def __post_init__(self) -> None:
        check_clip(self.eps_low, self.eps_high, self.dual_clip)
        if self.agg_mode not in AGG_MODES:
            raise ConfigError(f"unknown agg_mode {self.agg_mode!r}; expected one of {AGG_MODES}")
        if self.kl_estimator not in ("k1", "k2", "k3"):
            raise ConfigError(f"unknown kl_estimator {self.kl_estimator!r}; expected 'k1', 'k2' or 'k3'")
        if not self.kl_coef >= 0:  # NaN fails too
            raise ConfigError(f"kl_coef must be >= 0, got {self.kl_coef}")
        if self.tis_cap is not None and not self.tis_cap > 0:
            raise ConfigError(f"tis_cap must be > 0, got {self.tis_cap}")


@dataclass(frozen=True)
class PolicyLossResult:
    """The scalar loss to back-propagate and detached scalar metrics."""

    loss: torch.Tensor
    metrics: dict[str, float]


def policy_loss(
    config: PolicyLossConfig,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    ref_logprobs: torch.Tensor | None = None,
    rollout_logprobs: torch.Tensor | None = None,
    dp_group: dist.ProcessGroup | None = None,
) -> PolicyLossResult:
    """``aggregate( w_t * L^clip_t + kl_coef * KL_t )`` over response tokens (shapes ``[batch, seq]``).

    ``w_t`` is the TIS weight (1 unless ``config.tis_cap`` and ``rollout_logprobs`` are set).
    """
    out = ppo_clip_token_losses(
        logprobs, old_logprobs, advantages, config.eps_low, config.eps_high, config.dual_clip
    )
    token_losses = out.token_losses
    metrics: dict[str, float] = {}
    if config.tis_cap is not None and rollout_logprobs is not None:
        weights = truncated_is_weights(old_logprobs, rollout_logprobs, config.tis_cap)
        token_losses = token_losses * weights
        metrics["tis_weight_mean"] = float(masked_mean(weights, mask))
    if config.kl_coef > 0:
        if ref_logprobs is None:
            raise ConfigError(f"kl_coef={config.kl_coef} needs ref_logprobs")
        kl = kl_estimate(logprobs, ref_logprobs, config.kl_estimator)
        token_losses = token_losses + config.kl_coef * kl
        metrics["kl"] = float(masked_mean(kl.detach(), mask))
    loss = aggregate_loss(token_losses, mask, config.agg_mode, dp_group, config.norm_constant)
    metrics["clip_fraction"] = float(masked_mean(out.clipped.float(), mask))
    metrics["ratio_mean"] = float(masked_mean(out.ratio.detach(), mask))
    return PolicyLossResult(loss=loss, metrics=metrics)
