"""Pipeline parallelism for the chat trainers: ``--pp N --pp-schedule NAME --num-microbatches M``.

With ``pp > 1`` the trainer's Booster gets ``HybridPlugin(pp_size=pp, ...)``: the decoder layers are
split over ``pp`` consumer ranks (embedding on the first stage, norm + LM head on the last) and a
training step is ``booster.execute_pipeline(iter([batch]), model, criterion, optimizer)``, which splits
the batch into M microbatches along dim 0 and back-propagates Σ_i criterion(logits_i, mb_i) / M.

What the chat losses need, and how they get it:

* per-token log-probs over the full vocabulary: the last stage's output *is* the logits
  ``[b, s, V]`` (tp = 1), so the criterion computes the algorithm's loss from them. Each criterion
  returns (its microbatch's share of the step loss) · M, so the pipeline's mean over microbatches
  is exactly the loss the unpipelined trainer back-propagates (GRPO: Σ over microbatches of
  loss_j · units_j / global units · dp; SFT: Σ token log-probs / labelled tokens of the batch);
* left-padded prompts (GRPO): the microbatch carries ``position_ids`` (cumsum of the mask − 1),
  which every stage uses, as the unpipelined forward does;
* metrics exist on the last stage only: they are broadcast over the pipeline group;
* full tensors for the producers: every pp stage holds different layers, so the weight sync
  gathers them through the plugin's ``export_state`` (a collective over every consumer rank).

Refused with ConfigError before any model loads: dpo and rm (their losses pair rows across the
batch), LoRA (the stage split needs the plain HF model), tp > 1 together with pp > 1, and consumer
evaluation (greedy generation needs the whole model on one rank).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megalith.common.errors import ConfigError
from megalith_chat.algorithms import IGNORE_INDEX, token_logprobs

PP_COMMANDS = ("grpo", "sft")
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v")
Criterion = Callable[[torch.Tensor, dict[str, torch.Tensor]], torch.Tensor]


def check_pipeline(pp: int, tp: int, lora: bool, command: str = "grpo", schedule: str = "1f1b") -> None:
    """ConfigError naming the values, before any model is loaded or weight moved."""
    if pp < 1:
        raise ConfigError(f"--pp must be >= 1, got {pp}")
    if schedule not in PP_SCHEDULES:
        raise ConfigError(f"--pp-schedule {schedule!r} is not one of {PP_SCHEDULES}")
    if pp == 1:
        return
    if command not in PP_COMMANDS:
        raise ConfigError(
            f"--pp {pp} is supported for {' and '.join(PP_COMMANDS)}, not for {command} "
            "(its loss pairs chosen and rejected rows of one batch)"
        )
    if lora:
        raise ConfigError(f"LoRA (--lora-r > 0) with --pp {pp} is not supported: use --lora-r 0 with --pp")
    if tp > 1:
        raise ConfigError(
            f"--pp {pp} together with --tp {tp} is not supported by chat-train; use one of them"
        )


def model_chunks(schedule: str) -> int:
    """Stages per pipeline rank: 2 for the interleaved and V schedules, else 1."""
    return 2 if schedule in ("interleaved", "zb-v") else 1


def resolve_microbatches(pp: int, rows: int, num_microbatches: int | None, what: str) -> int:
    """``--num-microbatches`` (default: 2·pp, or ``rows`` when fewer), checked to divide the ``rows``
    of one pipeline step (``what`` names them) and to give every stage a microbatch."""
    m = num_microbatches if num_microbatches is not None else min(2 * pp, rows)
    if m < 1 or rows % m:
        raise ConfigError(f"--num-microbatches {m} must divide the {rows} {what} of one pipeline step")
    if m < pp:
        raise ConfigError(f"--num-microbatches {m} is fewer than the --pp {pp} pipeline stages")
    return m


def pipeline_options(pp: int, schedule: str, num_microbatches: int) -> dict[str, Any]:
    """HybridPlugin keyword arguments for the pipeline."""
    if pp == 1:
        return {}
    return {
        "pp_size": pp,
        "pp_schedule": schedule,
        "num_microbatches": num_microbatches,
        "num_model_chunks": model_chunks(schedule),
    }


def is_pipelined(booster: Any) -> bool:
    return getattr(booster.plugin, "pipeline", None) is not None


def num_microbatches(booster: Any) -> int:
    return int(booster.plugin.config.num_microbatches)


def share_from_last_stage(booster: Any, value: Any) -> Any:
    """``value`` as the rank holding the last stage has it, on every rank of its pipeline group."""
    state = booster.plugin.pipeline
    group = state.pp_group
    src = dist.get_global_rank(group, state.engine.last_rank) if group is not None else state.engine.last_rank
    box = [value]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def sft_step(
    booster: Any, model: nn.Module, optimizer: Any, batch: dict[str, torch.Tensor], accum: int
) -> dict[str, float]:
    """One SFT micro-step through the pipeline: the loss -Σ log p(labels) / labelled tokens of the
    whole batch (as ``sft_loss``), scaled by 1/accum for the backward; returns its metrics."""
    labels = batch["labels"]
    count = (labels[:, 1:] != IGNORE_INDEX).sum().clamp(min=1)
    scale = num_microbatches(booster) / accum

    def criterion(logits: torch.Tensor, mb: dict[str, torch.Tensor]) -> torch.Tensor:
        logp = token_logprobs(logits[:, :-1], mb["labels"][:, 1:])
        return -logp.sum() / count * scale

    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "labels")}
    out = booster.execute_pipeline(iter([inputs]), model, criterion, optimizer)
    return {"loss": float(out["loss"]) * accum, "tokens": float(count)}


def full_parameters(booster: Any, model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``(name, full tensor)`` of every parameter of the whole model, in a plain model's
    ``named_parameters()`` order (tied ones once): the plugin's ``export_state`` streams each tensor
    from the pp rank that holds it (a collective: every consumer rank calls this)."""
    buffers = {n for n, _ in model.named_buffers()}
    return [(n, t) for n, t in booster.plugin.export_state(model) if n not in buffers]
