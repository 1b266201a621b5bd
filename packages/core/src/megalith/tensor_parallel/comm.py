"""Megatron's communication operators as autograd Functions over a given `ProcessGroup`.

Tensor parallelism (Shoeybi et al. 2019, "Megatron-LM") needs two conjugate operators around a
column-parallel → row-parallel pair:

    f  (`copy_to_tp`):     identity in forward,  all-reduce in backward   (enters the parallel region)
    g  (`reduce_from_tp`): all-reduce in forward, identity in backward    (leaves it)

Sequence parallelism (Korthikanti et al. 2022, "Reducing Activation Recomputation") replaces them by
an all-gather / reduce-scatter pair along the sequence dimension:

    ḡ  (`gather_sequence`):         all-gather in forward,     reduce-scatter in backward
    ḡ* (`reduce_scatter_sequence`): reduce-scatter in forward, all-gather in backward

and Ulysses (Jacobs et al. 2023, "DeepSpeed Ulysses") exchanges heads and sequence with `all_to_all`,
whose backward is the inverse all-to-all. Every function is the identity on a group of size 1.
On gloo the all-gather / reduce-scatter use megalith's per-owner broadcast / reduce collectives.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.autograd import Function

from megalith.distributed import all_gather_flat, reduce_scatter_flat

Group = dist.ProcessGroup | None


def group_size(group: Group) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def group_rank(group: Group) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


# -- plain (non-autograd) collectives along one dimension -----------------------------------------
def all_gather_dim(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    """[.., n_local, ..] on every rank → [.., n * n_local, ..] (rank r's block at position r)."""
    n = group_size(group)
    if n == 1:
        return x
    front = x.movedim(dim, 0).contiguous()
    flat = torch.empty(n * front.numel(), dtype=x.dtype, device=x.device)
    flat.chunk(n)[group_rank(group)].copy_(front.view(-1))
    all_gather_flat(flat, group=group)
    out = flat.view(n * front.shape[0], *front.shape[1:])
    return out.movedim(0, dim)


def reduce_scatter_dim(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    """[.., n * n_local, ..] partial sums → this rank's block [.., n_local, ..] of the sum over ranks."""
    n = group_size(group)
    if n == 1:
        return x
    if x.shape[dim] % n:
        raise ValueError(f"dimension {dim} of size {x.shape[dim]} is not divisible by the group size {n}")
    front = x.movedim(dim, 0).contiguous()
    out = torch.empty(front.numel() // n, dtype=x.dtype, device=x.device)
    reduce_scatter_flat(out, front.view(-1), group=group)  # the flat input is scratch afterwards
    return out.view(front.shape[0] // n, *front.shape[1:]).movedim(0, dim)


def split_dim(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    """This rank's equal block of `x` along `dim` (contiguous copy)."""
    n = group_size(group)
    if n == 1:
        return x
    return x.chunk(n, dim=dim)[group_rank(group)].contiguous()


def all_reduce_sum(x: torch.Tensor, group: Group) -> torch.Tensor:
    if group_size(group) > 1:
        dist.all_reduce(x, group=group)
    return x


def all_to_all_dims(x: torch.Tensor, group: Group, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Split `x` into n blocks along `scatter_dim`, send block j to rank j, concatenate what arrives
    along `gather_dim`: [.., S, .., H/n ..] ↔ [.., S/n, .., H, ..]."""
    n = group_size(group)
    if n == 1:
        return x
    send = [c.contiguous() for c in x.chunk(n, dim=scatter_dim)]
    recv = [torch.empty_like(c) for c in send]
    dist.all_to_all(recv, send, group=group)
    return torch.cat(recv, dim=gather_dim)


# -- autograd operators -----------------------------------------------------------------------------
class _CopyToTP(Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return all_reduce_sum(grad.contiguous().clone(), ctx.group), None


class _ReduceFromTP(Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        return all_reduce_sum(x.contiguous().clone(), group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _GatherDim(Function):
    """Forward all-gather along `dim`; backward either takes this rank's block (the consumer is
    replicated, so its gradient is already complete) or reduce-scatters (the consumer is sharded, so
    every rank holds a partial gradient of the whole gathered tensor)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, dim: int, reduce_grad: bool) -> torch.Tensor:
        ctx.group, ctx.dim, ctx.reduce_grad = group, dim, reduce_grad
        return all_gather_dim(x, group, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        if ctx.reduce_grad:
            return reduce_scatter_dim(grad, ctx.group, ctx.dim), None, None, None
        return split_dim(grad, ctx.group, ctx.dim), None, None, None


class _SplitDim(Function):
    """Forward takes this rank's block along `dim`; backward all-gathers, or (`zero_grad_elsewhere`)
    pads with zeros, leaving the gradient partial so that it is summed with the parameters' ones."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, dim: int, pad_grad: bool) -> torch.Tensor:
        ctx.group, ctx.dim, ctx.pad_grad, ctx.full = group, dim, pad_grad, x.shape[dim]
        return split_dim(x, group, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        if not ctx.pad_grad:
            return all_gather_dim(grad.contiguous(), ctx.group, ctx.dim), None, None, None
        shape = list(grad.shape)
        shape[ctx.dim] = ctx.full
        out = grad.new_zeros(shape)
        local = grad.shape[ctx.dim]
        out.narrow(ctx.dim, group_rank(ctx.group) * local, local).copy_(grad)
        return out, None, None, None


class _ReduceScatterDim(Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return reduce_scatter_dim(x, group, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return all_gather_dim(grad.contiguous(), ctx.group, ctx.dim), None, None


class _AllToAll(Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, scatter_dim: int, gather_dim: int) -> torch.Tensor:
        ctx.group, ctx.scatter_dim, ctx.gather_dim = group, scatter_dim, gather_dim
        return all_to_all_dims(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return all_to_all_dims(grad, ctx.group, ctx.gather_dim, ctx.scatter_dim), None, None, None


# -- public functional forms ------------------------------------------------------------------------
def copy_to_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Megatron's f: identity forward, all-reduce backward (input of a column-parallel linear)."""
    return x if group_size(group) == 1 else _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Megatron's g: all-reduce forward, identity backward (output of a row-parallel linear)."""
    return x if group_size(group) == 1 else _ReduceFromTP.apply(x, group)


def gather_from_tp(x: torch.Tensor, group: Group, dim: int = -1) -> torch.Tensor:
    """All-gather shards of a replicated consumer's input ([.., n/tp] → [.., n]); backward splits."""
    return x if group_size(group) == 1 else _GatherDim.apply(x, group, dim % x.dim(), False)


def scatter_to_tp(x: torch.Tensor, group: Group, dim: int = -1) -> torch.Tensor:
    """Take this rank's block ([.., n] → [.., n/tp]); backward all-gathers."""
    return x if group_size(group) == 1 else _SplitDim.apply(x, group, dim % x.dim(), False)


def gather_sequence(x: torch.Tensor, group: Group, dim: int = 1) -> torch.Tensor:
    """Megatron-SP's ḡ: [b, s/tp, h] → [b, s, h]; backward reduce-scatters (consumers are sharded)."""
    return x if group_size(group) == 1 else _GatherDim.apply(x, group, dim % x.dim(), True)


def reduce_scatter_sequence(x: torch.Tensor, group: Group, dim: int = 1) -> torch.Tensor:
    """Megatron-SP's ḡ*: partial [b, s, h] → summed [b, s/tp, h]; backward all-gathers."""
    return x if group_size(group) == 1 else _ReduceScatterDim.apply(x, group, dim % x.dim())


def split_sequence(x: torch.Tensor, group: Group, dim: int = 1, pad_grad: bool = False) -> torch.Tensor:
    """[b, s, h] → this rank's [b, s/n, h]. Backward all-gathers, or with `pad_grad` pads with zeros
    (the upstream parameters' gradients are then partial and summed over the group like the rest)."""
    return x if group_size(group) == 1 else _SplitDim.apply(x, group, dim % x.dim(), pad_grad)


def all_to_all(x: torch.Tensor, group: Group, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Ulysses' exchange: split `scatter_dim` over ranks, concatenate along `gather_dim`."""
    if group_size(group) == 1:
        return x
    return _AllToAll.apply(x, group, scatter_dim % x.dim(), gather_dim % x.dim())
