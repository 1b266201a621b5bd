"""Sequence parallelism on the tensor-parallel group, attached to a model from outside with hooks.

`split_gather` (Megatron-SP, Korthikanti et al. 2022): between blocks the hidden states are
sequence shards [b, s/tp, h]; norms, residual adds and dropout run on shards. Each attention / MLP
block starts with one all-gather ([b, s/tp, h] → [b, s, h], reduce-scatter in backward) feeding its
column-parallel linears, and ends with the row-parallel linear's reduce-scatter. The replicated
norm weights then see only their shard's tokens: their gradients are summed over the group.

`all_to_all` (Ulysses, Jacobs et al. 2023): weights stay replicated and everything runs on sequence
shards except the attention core, which sees the full sequence and H/n heads:

    q/k/v = x_shard W   [b, s/n, H*d]  --all-to-all-->  [b, s, H/n*d]   (heads ↔ sequence)
    attention(q, k, v)  [b, s, H/n*d]  --all-to-all-->  [b, s/n, H*d]  --o_proj-->  [b, s/n, h]

HF attention modules derive their shapes from `hidden_states.shape[:-1]`, so the attention module's
input is presented as a [b, s, h/n] view of the [b, s/n, h] shard; its q/k/v projections undo the
view before projecting. Every parameter's gradient is then partial over the group and is summed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from megalith.common.errors import ConfigError
from megalith.tensor_parallel.comm import (
    Group,
    all_reduce_sum,
    all_to_all,
    copy_to_tp,
    gather_sequence,
    group_rank,
    group_size,
    reduce_from_tp,
    split_sequence,
)
from megalith.tensor_parallel.vocab import IGNORE_INDEX
from megalith.tensor_parallel.vocab import shift_labels as _shift

SequenceMode = Literal["none", "split_gather", "all_to_all"]
SEQUENCE_MODES: tuple[str, ...] = ("none", "split_gather", "all_to_all")
Hook = Callable[[nn.Module, tuple[Any, ...], dict[str, Any]], tuple[tuple[Any, ...], dict[str, Any]]]


def _on_hidden_states(fn: Callable[[torch.Tensor], torch.Tensor]) -> Hook:
    """A forward pre-hook applying `fn` to the module's `hidden_states` (kwarg or first positional)."""

    def hook(
        module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        del module
        if "hidden_states" in kwargs:
            kwargs = {**kwargs, "hidden_states": fn(kwargs["hidden_states"])}
        else:
            args = (fn(args[0]), *args[1:])
        return args, kwargs

    return hook


def check_sequence_length(seq_len: int, n: int) -> None:
    if seq_len % n:
        raise ConfigError(
            f"sequence length {seq_len} is not divisible by the sequence-parallel size {n}; "
            f"pad the batch to a multiple of {n}"
        )


def check_sequence_at_entry(model: nn.Module, n: int) -> None:
    """Check the sequence length of `input_ids` / `inputs_embeds` before the model computes anything."""

    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        x = kwargs.get("input_ids")
        if x is None:
            x = kwargs.get("inputs_embeds")
        if x is None and args:
            x = args[0]
        if isinstance(x, torch.Tensor) and x.dim() >= 2:
            check_sequence_length(x.shape[1], n)

    model.register_forward_pre_hook(hook, with_kwargs=True)


def split_sequence_before(module: nn.Module, group: Group, pad_grad: bool) -> None:
    """Inputs of `module` (the first decoder layer) become this rank's sequence shard [b, s/n, h]."""

    def split(x: torch.Tensor) -> torch.Tensor:
        check_sequence_length(x.shape[1], group_size(group))
        return split_sequence(x, group, dim=1, pad_grad=pad_grad)

    module.register_forward_pre_hook(_on_hidden_states(split), with_kwargs=True)


def enter_block(module: nn.Module, group: Group, sequence_parallel: bool) -> None:
    """One entry operator for all column-parallel linears of a block (q/k/v, or gate/up), so the
    backward reduces their summed input gradient once: Megatron's f (all-reduce in backward), or
    under Megatron-SP the all-gather of [b, s/tp, h] (reduce-scatter in backward)."""
    if sequence_parallel:
        hook = _on_hidden_states(lambda x: gather_sequence(x, group, dim=1))
    else:
        hook = _on_hidden_states(lambda x: copy_to_tp(x, group))
    module.register_forward_pre_hook(hook, with_kwargs=True)


def add_ulysses(attention: nn.Module, projections: tuple[str, ...], output: str, group: Group) -> None:
    """Attach the Ulysses exchange to an attention module: q/k/v projections named `projections`
    and the output projection named `output` (submodule names, e.g. "q_proj", "o_proj")."""
    n = group_size(group)

    def as_carrier(x: torch.Tensor) -> torch.Tensor:  # [b, s/n, h] → [b, s, h/n] view
        b, s_local, h = x.shape
        return x.reshape(b, s_local * n, h // n)

    attention.register_forward_pre_hook(_on_hidden_states(as_carrier), with_kwargs=True)
    for name in projections:
        proj = attention.get_submodule(name)
        in_features = int(proj.in_features)  # type: ignore[arg-type]

        def unview(module: nn.Module, args: tuple[Any, ...], h: int = in_features) -> tuple[Any, ...]:
            x = args[0]
            return (x.reshape(x.shape[0], -1, h), *args[1:])

        def exchange(module: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor:
            return all_to_all(out, group, scatter_dim=-1, gather_dim=1)  # [b, s/n, H*d] → [b, s, H/n*d]

        proj.register_forward_pre_hook(unview)
        proj.register_forward_hook(exchange)

    def back(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return (all_to_all(args[0], group, scatter_dim=1, gather_dim=-1), *args[1:])

    attention.get_submodule(output).register_forward_pre_hook(back)


def sequence_sharded_lm_loss(group: Group) -> Callable[..., torch.Tensor]:
    """HF `loss_function` drop-in for logits that are sequence shards [b, s/n, V] (Ulysses): the
    labels are shifted on the full sequence, then this rank's shard is scored; the token sum and
    count are summed over the group (the sum through g, so each rank's gradient stays its own part)."""

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
        n, local = group_size(group), logits.shape[1]
        target = (
            target.narrow(1, group_rank(group) * local, local) if target.shape[1] == local * n else target
        )
        target = target.reshape(-1).to(logits.device)
        total = F.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]), target, ignore_index=ignore_index, reduction="sum"
        )
        total = reduce_from_tp(total, group)
        if num_items_in_batch is not None:
            return total / num_items_in_batch
        count = all_reduce_sum((target != ignore_index).sum().to(total.dtype), group)
        return total / count

    return loss_function
