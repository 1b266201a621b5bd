"""Advantage estimators for outcome-reward RL (GRPO family, RLOO, REINFORCE++) and PPO's GAE.

Layout convention for group methods: ``rewards`` is ``[num_prompts * G]`` with the ``G``
samples of prompt ``k`` stored contiguously at ``k*G .. k*G + G - 1``. Sequence-level
advantages are returned with the same shape; broadcast them over response tokens with
``adv[:, None] * mask``.

Groups whose rewards are all equal carry no learning signal: every group method returns
exactly ``0`` for them (no NaN, no ``eps``-sized noise), and a group of one sample has
advantage ``0`` (its own reward is its baseline).
"""

from __future__ import annotations

import torch

from megalith.common.errors import ConfigError
from megalith_chat.algorithms.logprobs import _check_same_shape, masked_whiten


def _grouped(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """``[num_prompts * G]`` -> ``[num_prompts, G]`` (float32), validating the layout."""
    if rewards.dim() != 1:
        raise ConfigError(f"rewards must be 1-D [num_prompts * G], got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size != 0:
        raise ConfigError(
            f"group_size must be >= 1 and divide the number of rewards ({rewards.numel()}), got {group_size}"
        )
    return rewards.float().reshape(-1, group_size)


def _zero_constant_groups(adv: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """Exact zeros for groups whose rewards are all equal (guards against float round-off)."""
    constant = groups.amax(dim=1, keepdim=True) == groups.amin(dim=1, keepdim=True)
    return torch.where(constant, torch.zeros_like(adv), adv)


def grpo_advantages(
    rewards: torch.Tensor, group_size: int, eps: float = 1e-6, scale_by_std: bool = True
) -> torch.Tensor:
    """GRPO outcome advantages (Shao et al. 2024, DeepSeekMath, eq. for outcome supervision).

    ``A_i = (r_i - mean_g(r)) / (std_g(r) + eps)`` where ``mean_g``/``std_g`` run over the
    ``G`` samples of the same prompt and ``std_g`` is the Bessel-corrected sample std
    (``sqrt(sum (r - mean)^2 / (G - 1))``). ``scale_by_std=False`` gives Dr.GRPO.

    Shapes: rewards ``[num_prompts * G]`` -> ``[num_prompts * G]`` float32.
    """
    groups = _grouped(rewards, group_size)
    centred = groups - groups.mean(dim=1, keepdim=True)
    if scale_by_std and group_size > 1:
        std = groups.std(dim=1, keepdim=True, unbiased=True)
        centred = centred / (std + eps)
    return _zero_constant_groups(centred, groups).reshape(-1)


def dr_grpo_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Dr.GRPO advantages (Liu et al. 2025, "Understanding R1-Zero-Like Training").

    ``A_i = r_i - mean_g(r)``: the std division of GRPO is dropped because it up-weights
    prompts that are too easy or too hard (question-level difficulty bias). Pair it with the
    ``seq-mean-token-sum-norm`` loss aggregation to also remove the response-length bias.

    Shapes: rewards ``[num_prompts * G]`` -> ``[num_prompts * G]`` float32.
    """
    return grpo_advantages(rewards, group_size, scale_by_std=False)


def rloo_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """REINFORCE Leave-One-Out advantages (Ahmadian et al. 2024, "Back to Basics").

    ``A_i = r_i - (1/(G-1)) sum_{j != i} r_j = G/(G-1) * (r_i - mean_g(r))``: each sample's
    baseline is the mean of the other samples of its prompt, so it is unbiased. Needs ``G >= 2``.

    Shapes: rewards ``[num_prompts * G]`` -> ``[num_prompts * G]`` float32.
    """
    if group_size < 2:
        raise ConfigError(f"RLOO needs at least 2 samples per prompt, got group_size={group_size}")
    groups = _grouped(rewards, group_size)
    others_mean = (groups.sum(dim=1, keepdim=True) - groups) / (group_size - 1)
    return _zero_constant_groups(groups - others_mean, groups).reshape(-1)


def reinforce_pp_baseline_advantages(
    rewards: torch.Tensor, group_size: int, eps: float = 1e-6
) -> torch.Tensor:
    """REINFORCE++-baseline advantages (Hu 2025, "REINFORCE++", the group-baseline variant).

    ``A'_i = r_i - mean_g(r)`` (subtract the prompt's group mean), then normalise over the
    whole batch: ``A_i = (A'_i - mean_batch(A')) / (std_batch(A') + eps)`` with the population
    std. The global (not per-group) std keeps the scale stable when a group has tiny variance.

    Shapes: rewards ``[num_prompts * G]`` -> ``[num_prompts * G]`` float32.
    """
    centred = grpo_advantages(rewards, group_size, scale_by_std=False)
    if bool((centred == 0).all()):
        return centred
    batch_centred = centred - centred.mean()
    return batch_centred / (batch_centred.pow(2).mean().sqrt() + eps)


def discounted_returns(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """Reward-to-go ``G_t = sum_{s >= t} gamma^(s-t) * m_s * r_s`` along the sequence.

    Shapes: ``[batch, seq]`` -> ``[batch, seq]`` (0 where ``mask`` is 0).
    """
    _check_same_shape(token_rewards=token_rewards, mask=mask)
    m = mask.float()
    r = token_rewards.float() * m
    out = torch.zeros_like(r)
    running = torch.zeros_like(r[:, 0])
    for t in range(r.shape[1] - 1, -1, -1):
        running = r[:, t] + gamma * running
        out[:, t] = running
    return out * m


def reinforce_pp_advantages(
    token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0, eps: float = 1e-8
) -> torch.Tensor:
    """REINFORCE++ token advantages (Hu 2025): whitened reward-to-go, no critic.

    ``A_t = whiten(G_t)`` where ``G_t`` is :func:`discounted_returns` of the token rewards (the
    outcome score at the last response token minus ``beta * KL_t`` per token, see
    :func:`megalith_chat.algorithms.kl.kl_shaped_rewards`) and the mean/std run over every
    masked token of the batch.

    Shapes: ``[batch, seq]`` -> ``[batch, seq]``.
    """
    return masked_whiten(discounted_returns(token_rewards, mask, gamma), mask, eps)


def gae_advantages(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 0.95,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised Advantage Estimation for PPO (Schulman et al. 2016; used by PPO, Schulman et al. 2017).

    ``delta_t = r_t + gamma * V_{t+1} - V_t`` and ``A_t = delta_t + gamma * lam * A_{t+1}``;
    the value after the last response token is 0 (the episode ends). Returns
    ``(advantages, returns)`` with ``returns = A + V`` (the critic's regression target).
    ``mask`` must be a contiguous run of response tokens per row followed by padding.

    Shapes: token_rewards, values, mask ``[batch, seq]`` -> two ``[batch, seq]`` tensors, 0 off-mask.
    """
    _check_same_shape(token_rewards=token_rewards, values=values, mask=mask)
    m = mask.float()
    r = token_rewards.float() * m
    v = values.float() * m
    adv = torch.zeros_like(r)
    next_value = torch.zeros_like(r[:, 0])
    next_adv = torch.zeros_like(r[:, 0])
    for t in range(r.shape[1] - 1, -1, -1):
        delta = r[:, t] + gamma * next_value - v[:, t]
        next_adv = (delta + gamma * lam * next_adv) * m[:, t]
        adv[:, t] = next_adv
        next_value = v[:, t]
    return adv, (adv + v) * m
