"""Tensor (and sequence) parallelism for the chat trainers: ``--tp N --sp-mode none|split_gather``.

With ``tp > 1`` the trainer's Booster gets ``HybridPlugin(tp_size=tp, sp_mode=..., zero_stage=...)``
(``--plugin ddp|zero1|zero2`` picks ZeRO over the ``dp = world / tp`` axis). What the chat losses
need from the sharded model, and how they get it:

* full logits ``[B, S, V]``: GRPO, DPO and SFT score tokens with ``log_softmax`` over the whole
  vocabulary, so the plan gathers the vocabulary-parallel logits (``gather_logits=True``);
  Ulysses (``all_to_all``) leaves the logits as sequence shards and is refused;
* a sequence length divisible by tp under ``split_gather``: batches are right-padded inside the
  forward (padding masked out, causal attention keeps earlier positions exact) and the logits cut
  back to the caller's length;
* full tensors for the producers: the weight sync gathers every tp block (a collective over the tp
  group of consumer rank 0) and sends the HF-shaped parameters (`full_parameters`).

LoRA with tp > 1 is refused: peft wraps the projections the tensor-parallel plan shards.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import nn

from megalith.common.errors import ConfigError

CHAT_SP_MODES = ("none", "split_gather")
ZERO_STAGES = {"ddp": 0, "zero1": 1, "zero2": 2}


def check_parallel(tp: int, sp_mode: str, lora: bool, command: str = "grpo") -> None:
    """ConfigError naming the values, before any model is loaded or weight moved."""
    if tp < 1:
        raise ConfigError(f"--tp must be >= 1, got {tp}")
    if sp_mode not in CHAT_SP_MODES:
        raise ConfigError(
            f"--sp-mode {sp_mode!r} is not supported by chat-train (choose from {CHAT_SP_MODES}): the "
            "chat losses read full-sequence logits, which all_to_all (Ulysses) leaves as sequence shards"
        )
    if tp == 1 and sp_mode != "none":
        raise ConfigError(
            f"--sp-mode {sp_mode} runs on the tensor-parallel group: it needs --tp > 1, got --tp 1"
        )
    if tp > 1 and lora:
        raise ConfigError(
            f"LoRA (--lora-r > 0) with --tp {tp} is not supported: peft wraps the projections that tensor "
            "parallelism shards; use --lora-r 0 (full fine-tuning) with --tp, or --tp 1 with LoRA"
        )
    if tp > 1 and command == "rm":
        raise ConfigError(
            f"--tp {tp} is supported for grpo, sft and dpo, not for rm (the sequence-classification "
            "model has no tensor-parallel policy)"
        )


def hybrid_plugin(
    model: nn.Module, plugin: str, tp: int, sp_mode: str, pipeline: dict[str, Any] | None = None
) -> Any:
    """The HybridPlugin for ``model`` with gathered logits (``plugin`` picks ZeRO over dp;
    ``pipeline``: its pp options, trainer/pp.py)."""
    from megalith.booster.plugins import HybridPlugin
    from megalith.policies import policy_for

    plan = replace(policy_for(model).plan_for(model), gather_logits=True)
    return HybridPlugin(
        tp_size=tp, sp_mode=sp_mode, zero_stage=ZERO_STAGES[plugin], policy=plan, **(pipeline or {})
    )


def pad_sequence_to_multiple(model: nn.Module, multiple: int) -> None:
    """Right-pad ``input_ids`` / ``attention_mask`` / ``position_ids`` / ``labels`` to a multiple
    of ``multiple`` before ``model``'s forward and cut ``logits`` back to the original length.

    Causal attention: positions before the padding see exactly the tokens they saw before; the
    padded positions are masked keys (mask 0) and their labels are -100."""
    lengths: list[int] = []
    fills = {"input_ids": 0, "attention_mask": 0, "labels": -100}

    def pad(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if not isinstance(ids, torch.Tensor) or args:
            lengths.append(-1)
            return args, kwargs
        s = ids.shape[1]
        extra = -s % multiple
        lengths.append(s)
        if extra == 0:
            return args, kwargs
        out = dict(kwargs)
        for key, value in kwargs.items():
            if key in fills and isinstance(value, torch.Tensor):
                out[key] = torch.nn.functional.pad(value, (0, extra), value=fills[key])
        if isinstance(kwargs.get("position_ids"), torch.Tensor):
            last = kwargs["position_ids"][:, -1:]
            out["position_ids"] = torch.cat(
                [kwargs["position_ids"], last + 1 + torch.arange(extra, device=last.device)], dim=1
            )
        return args, out

    def cut(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
        s = lengths.pop()
        logits = getattr(output, "logits", None)
        if s >= 0 and isinstance(logits, torch.Tensor) and logits.shape[1] != s:
            output.logits = logits[:, :s]
        return output

    # prepend: runs before the core's sequence-length check registered at boost
    model.register_forward_pre_hook(pad, with_kwargs=True, prepend=True)
    model.register_forward_hook(cut, with_kwargs=True)


def full_parameters(booster: Any, model: nn.Module, trainable_only: bool) -> list[tuple[str, torch.Tensor]]:
    """``(name, full tensor)`` in ``model.named_parameters()`` order, tp blocks gathered (a collective
    over the tp group: every rank of it calls this). Same names, order and shapes as a plain copy
    of the model, i.e. what the producers' ``receive_weights`` expects."""
    from megalith.tensor_parallel import full_state_dict

    full = full_state_dict(model, booster.plugin.tp_group)
    return [(n, full[n]) for n, p in model.named_parameters() if p.requires_grad or not trainable_only]
