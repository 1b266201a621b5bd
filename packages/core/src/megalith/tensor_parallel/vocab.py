"""Vocabulary-parallel embedding, LM head and cross-entropy (Megatron-LM).

The vocabulary V is padded to Vp = ceil(V/tp)*tp and rank r owns rows [r*Vp/tp, (r+1)*Vp/tp) of the
embedding / LM-head weight ([Vp/tp, h] locally). Padded rows are never looked up and the head only
computes the real ones, so they stay zero. The cross-entropy works on the local logits
[N, V_r] and never materialises the full [N, V]:

    m   = max_r max_j z_rj                 (all-reduce MAX)
    S   = Σ_r Σ_j exp(z_rj - m)            (all-reduce SUM)
    z_t = the target's logit - m, taken on the rank that owns it (all-reduce SUM)
    loss = log S - z_t,    ∂loss/∂z_rj = softmax_rj - [j is the target]
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.autograd import Function

from megalith.tensor_parallel.comm import (
    Group,
    all_reduce_sum,
    copy_to_tp,
    gather_from_tp,
    gather_sequence,
    group_rank,
    group_size,
    reduce_from_tp,
)
from megalith.tensor_parallel.layers import InputOp, ShardSpec, sharded_parameter

IGNORE_INDEX = -100


def vocab_spec(weight: torch.Tensor, group: Group) -> ShardSpec:
    return ShardSpec(tuple(weight.shape), 0, (weight.shape[0],), group_size(group), group_rank(group))


class VocabParallelEmbedding(nn.Module):
    """nn.Embedding with rows split over the group: each rank looks up the ids it owns (zeros for
    the others) and g (all-reduce) sums the partial [.., h] outputs."""

    def __init__(self, embedding: nn.Embedding, group: Group, weight: nn.Parameter | None = None) -> None:
        super().__init__()
        self.group = group
        self.num_embeddings, self.embedding_dim = embedding.num_embeddings, embedding.embedding_dim
        spec = vocab_spec(embedding.weight, group)
        self.weight = (
            weight
            if weight is not None
            else sharded_parameter(embedding.weight, spec, embedding.weight.requires_grad)
        )
        self.vocab_start = spec.tp_rank * spec.block(self.num_embeddings)
        self.num_local = spec.valid(self.num_embeddings)
        pad = embedding.padding_idx
        local_pad = None if pad is None else pad - self.vocab_start
        self.local_padding_idx = (
            local_pad if local_pad is not None and 0 <= local_pad < self.num_local else None
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.vocab_start) | (ids >= self.vocab_start + self.num_local)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight, self.local_padding_idx)  # [.., h]
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp(out, self.group)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, rows [{self.vocab_start}, {self.vocab_start + self.num_local})"


class VocabParallelLMHead(nn.Module):
    """Bias-free LM head with the vocabulary split over the group: [.., h] → local logits [.., V_r]
    for vocabulary ids [vocab_start, vocab_start + num_local). Pass the embedding's parameter as
    `weight` to keep tied weights tied. `input_op` as for `ColumnParallelLinear`."""

    def __init__(
        self,
        linear: nn.Linear,
        group: Group,
        weight: nn.Parameter | None = None,
        input_op: InputOp = "copy",
        gather_output: bool = False,
    ) -> None:
        super().__init__()
        self.group, self.input_op, self.gather_output = group, input_op, gather_output
        self.in_features, self.out_features = linear.in_features, linear.out_features
        spec = vocab_spec(linear.weight, group)
        self.weight = (
            weight
            if weight is not None
            else sharded_parameter(linear.weight, spec, linear.weight.requires_grad)
        )
        self.vocab_start = spec.tp_rank * spec.block(self.out_features)
        self.num_local = spec.valid(self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_op == "copy":
            x = copy_to_tp(x, self.group)
        elif self.input_op == "gather_sequence":
            x = gather_sequence(x, self.group)
        logits = F.linear(x, self.weight[: self.num_local])  # [.., V_r]
        if not self.gather_output:
            return logits
        pad = self.weight.shape[0] - self.num_local
        padded = F.pad(logits, (0, pad)) if pad else logits
        return gather_from_tp(padded, self.group)[..., : self.out_features]

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, rows [{self.vocab_start}, {self.vocab_start + self.num_local})"


class _VocabParallelCE(Function):
    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        target: torch.Tensor,
        vocab_start: int,
        group: Group,
        ignore_index: int,
    ) -> torch.Tensor:
        n_local = logits.shape[-1]
        if n_local:
            m = logits.max(dim=-1).values
        else:  # a rank whose vocabulary block is all padding
            m = logits.new_full(logits.shape[:-1], float("-inf"))
        if group_size(group) > 1:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        z = logits - m.unsqueeze(-1)
        valid = target != ignore_index
        owned = valid & (target >= vocab_start) & (target < vocab_start + n_local)
        index = (target - vocab_start).clamp(0, max(n_local - 1, 0)).masked_fill(~owned, 0)
        picked = z.gather(-1, index.unsqueeze(-1)).squeeze(-1) if n_local else z.new_zeros(target.shape)
        picked = picked.masked_fill(~owned, 0.0)
        exp = z.exp()
        sum_exp = exp.sum(dim=-1)
        stats = all_reduce_sum(torch.stack([picked, sum_exp]), group)
        loss = (stats[1].log() - stats[0]).masked_fill(~valid, 0.0)
        ctx.save_for_backward(exp.div_(stats[1].unsqueeze(-1)), index, owned, valid)
        return loss

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None, None]:
        softmax, index, owned, valid = ctx.saved_tensors
        g = softmax.clone()
        if g.shape[-1]:
            g.scatter_add_(-1, index.unsqueeze(-1), -owned.to(g.dtype).unsqueeze(-1))
        g.mul_((grad * valid.to(grad.dtype)).unsqueeze(-1))
        return g, None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    group: Group,
    vocab_start: int,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """Per-token cross-entropy [N] from vocabulary-sharded logits [N, V_r] (0 where ignored).

    Equals `F.cross_entropy(full_logits, target, reduction="none", ignore_index=...)`."""
    return _VocabParallelCE.apply(logits, target, vocab_start, group, ignore_index)


def shift_labels(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Causal-LM targets: position t predicts token t+1; the last position is ignored."""
    return F.pad(labels, (0, 1), value=ignore_index)[..., 1:]


def causal_lm_loss(head: VocabParallelLMHead) -> Callable[..., torch.Tensor]:
    """A drop-in for HF's `model.loss_function` (ForCausalLM) on vocabulary-sharded logits:
    mean over non-ignored tokens, or sum / `num_items_in_batch` when given."""

    def loss_function(
        logits: torch.Tensor,
        labels: torch.Tensor,
        vocab_size: int | None = None,
        num_items_in_batch: torch.Tensor | int | None = None,
        ignore_index: int = IGNORE_INDEX,
        shift_labels: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        del vocab_size, kwargs
        target = _shift(labels, ignore_index) if shift_labels is None else shift_labels
        target = target.reshape(-1).to(logits.device)
        per_token = vocab_parallel_cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]), target, head.group, head.vocab_start, ignore_index
        )
        denom = (target != ignore_index).sum() if num_items_in_batch is None else num_items_in_batch
        return per_token.sum() / denom

    return loss_function


_shift = shift_labels
