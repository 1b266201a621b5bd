"""Per-token log-probabilities and masked reductions.

Every RL and preference loss in this package consumes per-token log-probabilities
``log pi(y_t | x, y_<t)`` and a 0/1 mask over the tokens that count (response tokens).
"""

from __future__ import annotations

import torch

from megalith.common.errors import ConfigError

IGNORE_INDEX = -100


def _check_same_shape(**tensors: torch.Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) > 1:
        raise ConfigError(f"tensors must have the same shape, got {shapes}")


def token_logprobs(
    logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = IGNORE_INDEX
) -> torch.Tensor:
    """Log-probability of each label under the logits at the same position.

    ``out[b, t] = log_softmax(logits[b, t])[labels[b, t]]``, and ``0`` where
    ``labels[b, t] == ignore_index``. Positions are *aligned*: ``logits[:, t]`` scores
    ``labels[:, t]``; for a causal LM pass ``logits[:, :-1]`` and ``input_ids[:, 1:]``.
    The softmax is taken in float32 for stability whatever the logits' dtype.

    Shapes: logits ``[batch, seq, vocab]``, labels ``[batch, seq]`` -> ``[batch, seq]`` float32.
    """
    if logits.dim() != 3 or labels.dim() != 2 or logits.shape[:2] != labels.shape:
        raise ConfigError(
            f"expected logits [batch, seq, vocab] and labels [batch, seq], got "
            f"{tuple(logits.shape)} and {tuple(labels.shape)}"
        )
    valid = labels != ignore_index
    safe_labels = torch.where(valid, labels, torch.zeros_like(labels))
    logp = torch.log_softmax(logits.float(), dim=-1)
    picked = torch.gather(logp, dim=-1, index=safe_labels.unsqueeze(-1)).squeeze(-1)
    return picked * valid.to(picked.dtype)


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """``sum(values * mask)`` over ``dim`` (all elements when ``None``)."""
    _check_same_shape(values=values, mask=mask)
    prod = values * mask.to(values.dtype)
    return prod.sum() if dim is None else prod.sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """``sum(values * mask) / sum(mask)`` over ``dim``; rows with an empty mask give 0, not NaN."""
    total = masked_sum(values, mask, dim)
    count = mask.to(values.dtype).sum() if dim is None else mask.to(values.dtype).sum(dim=dim)
    return total / count.clamp(min=1.0)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """``(values - mean) / (std + eps)`` with mean and (population) std over masked entries only.

    Masked-out entries are returned as 0.
    """
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask)
    return (values - mean) / (var.sqrt() + eps) * mask.to(values.dtype)


def sequence_logprobs(logprobs: torch.Tensor, mask: torch.Tensor, average: bool = False) -> torch.Tensor:
    """Sequence log-likelihood from token log-probs: ``sum_t m_t * logp_t`` (or its mean over tokens).

    ``average=True`` gives the length-normalised ``(1/|y|) sum_t logp_t`` used by SimPO and ORPO.
    Shapes: ``[batch, seq]`` -> ``[batch]``.
    """
    return masked_mean(logprobs, mask, dim=-1) if average else masked_sum(logprobs, mask, dim=-1)
