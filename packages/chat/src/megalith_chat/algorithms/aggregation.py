"""Reducing a ``[batch, seq]`` tensor of per-token losses to the scalar that is back-propagated.

The choice matters (Liu et al. 2025, Dr.GRPO; Yu et al. 2025, DAPO):

* ``token-mean``               ``sum_{b,t} m l / sum_{b,t} m`` -- every token weighs the same
  (DAPO's token-level loss); with a ``dp_group`` the token count is all-reduced so the mean is
  over the *global* batch.
* ``seq-mean-token-mean``      ``mean_b( sum_t m l / sum_t m )`` -- original GRPO; short
  responses weigh more per token (length bias).
* ``seq-mean-token-sum``       ``mean_b( sum_t m l )``.
* ``seq-mean-token-sum-norm``  ``mean_b( sum_t m l / C )`` with a constant ``C`` (default: the
  padded length ``seq``, i.e. the generation budget) -- Dr.GRPO's unbiased normaliser.

``mean_b`` runs over sequences with at least one masked token.

Distributed: pass the data-parallel ``dp_group`` and the denominator (token or sequence count)
is all-reduced over it; the local loss is then ``local_sum / global_count * dp_world_size``,
so that the *average* of gradients that DDP/ZeRO perform equals the gradient of the global
mean. ``dp_group=None`` reduces locally (single process, or each rank on its own).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist

from megalith.common.errors import ConfigError
from megalith_chat.algorithms.logprobs import _check_same_shape

AggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
AGG_MODES: tuple[str, ...] = (
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
)


def _global_count(local: torch.Tensor, dp_group: dist.ProcessGroup | None) -> tuple[torch.Tensor, int]:
    """All-reduce a (detached) count over ``dp_group``; returns ``(global_count, world_size)``."""
    if dp_group is None:
        return local, 1
    count = local.detach().clone()
    dist.all_reduce(count, op=dist.ReduceOp.SUM, group=dp_group)
    return count, dist.get_world_size(group=dp_group)


def aggregate_loss(
    token_losses: torch.Tensor,
    mask: torch.Tensor,
    mode: AggMode = "token-mean",
    dp_group: dist.ProcessGroup | None = None,
    norm_constant: float | None = None,
) -> torch.Tensor:
    """Reduce per-token losses ``[batch, seq]`` under ``mask`` ``[batch, seq]`` to a scalar (see module doc).

    ``norm_constant`` is the ``C`` of ``seq-mean-token-sum-norm`` (default ``seq``); it is
    rejected for other modes so that a misconfiguration is not silently ignored.
    """
    _check_same_shape(token_losses=token_losses, mask=mask)
    if mode not in AGG_MODES:
        raise ConfigError(f"unknown loss aggregation mode {mode!r}; expected one of {AGG_MODES}")
    if norm_constant is not None and mode != "seq-mean-token-sum-norm":
        raise ConfigError(
            f"norm_constant={norm_constant} only applies to 'seq-mean-token-sum-norm', not {mode!r}"
        )
    m = mask.to(token_losses.dtype)
    if mode == "token-mean":
        count, world = _global_count(m.sum(), dp_group)
        return (token_losses * m).sum() / count.clamp(min=1.0) * world
    per_seq_tokens = m.sum(dim=-1)
    per_seq = (token_losses * m).sum(dim=-1)
    if mode == "seq-mean-token-mean":
        per_seq = per_seq / per_seq_tokens.clamp(min=1.0)
    elif mode == "seq-mean-token-sum-norm":
        constant = float(token_losses.shape[-1]) if norm_constant is None else norm_constant
        if constant <= 0:
            raise ConfigError(f"norm_constant must be > 0, got {constant}")
        per_seq = per_seq / constant
    num_seqs, world = _global_count((per_seq_tokens > 0).to(token_losses.dtype).sum(), dp_group)
    return per_seq.sum() / num_seqs.clamp(min=1.0) * world
