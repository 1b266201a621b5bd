"""Recipes of ``chat-train sft | dpo | rm``: load model and data, boost, run the shared loop, export."""

from __future__ import annotations

import argparse
import copy
from pathlib import Path
from typing import Any

from megalith.common.errors import ConfigError
from megalith.distributed import rank as dist_rank
from megalith_chat.modeling import (
    LoraSpec,
    export_hf,
    is_peft,
    load_policy,
    load_tokenizer_dir,
    resolve_model,
)
from megalith_chat.rollout.generation import pad_token_id
from megalith_chat.trainer.loop import LoopConfig, train_loop
from megalith_chat.trainer.parallel import check_parallel, pad_sequence_to_multiple
from megalith_chat.trainer.pp import check_pipeline, pipeline_options, resolve_microbatches, sft_step
from megalith_chat.trainer.setup import make_booster, make_optimizer
from megalith_chat.trainer.supervised import (
    ListDataset,
    dpo_loss_fn,
    load_reward_model,
    pair_collate,
    preference_dataset,
    rm_loss,
    sft_collate,
    sft_dataset,
    sft_loss,
    with_reference_logps,
)


def _lora(args: argparse.Namespace) -> LoraSpec | None:
    return LoraSpec.for_rank(args.lora_r, args.lora_alpha)  # alpha: 2 x rank unless given


def _model_and_data(
    args: argparse.Namespace, model_dir: Path, tokenizer: Any
) -> tuple[Any, ListDataset, Any]:
    pad = pad_token_id(tokenizer)
    if args.command == "sft":  # the data first: a bad record is reported before the model loads
        examples = sft_dataset(str(args.data), tokenizer, args.max_length)
        return load_policy(model_dir, _lora(args), args.seed), examples, sft_collate(pad)
    pairs = preference_dataset(str(args.data), tokenizer, args.max_length)
    if args.command == "rm":
        if args.lora_r > 0:
            raise ConfigError("--lora-r is supported for sft, dpo and grpo, not for rm")
        return load_reward_model(str(model_dir)), ListDataset(pairs), pair_collate(pad)
    model = load_policy(model_dir, _lora(args), args.seed)
    if is_peft(model):
        with model.disable_adapter():
            data = with_reference_logps(model, pairs, pad)
    else:
        data = with_reference_logps(copy.deepcopy(model).eval(), pairs, pad)
    return model, data, pair_collate(pad)


def _pipeline(args: argparse.Namespace) -> dict[str, Any]:
    """HybridPlugin pp options of ``--pp / --pp-schedule / --num-microbatches`` (checked first)."""
    pp, schedule = getattr(args, "pp", 1), getattr(args, "pp_schedule", "1f1b")
    check_pipeline(pp, args.tp, args.lora_r > 0, args.command, schedule)
    if pp == 1:
        return {}
    m = resolve_microbatches(pp, args.batch_size, args.num_microbatches, "examples of --batch-size")
    return pipeline_options(pp, schedule, m)


def check_parallel_flags(args: argparse.Namespace) -> dict[str, Any]:
    """``ConfigError`` naming the flags for a --tp / --sp-mode / --pp / --pp-schedule /
    --num-microbatches combination this command cannot run; returns the pipeline options."""
    check_parallel(args.tp, args.sp_mode, args.lora_r > 0, args.command)
    return _pipeline(args)


def run_supervised_command(args: argparse.Namespace) -> list[dict[str, float]]:
    """One sft / dpo / rm run (inside an initialised process group, or a single process)."""
    import torch

    pipeline = check_parallel_flags(args)  # before any model loads
    torch.manual_seed(args.seed)
    model_dir = resolve_model(args.model, args.data_dir)
    tokenizer = load_tokenizer_dir(model_dir)
    model, dataset, collate = _model_and_data(args, model_dir, tokenizer)
    booster = make_booster(args.plugin, args.precision, args.tp, args.sp_mode, model, pipeline)
    model, optimizer, *_ = booster.boost(model, make_optimizer(model, args.lr))
    if args.sp_mode == "split_gather":
        pad_sequence_to_multiple(model, args.tp)
    loader = booster.prepare_dataloader(
        dataset, args.batch_size, shuffle=True, seed=args.seed, collate_fn=collate
    )
    loss_fn = {"sft": sft_loss, "rm": rm_loss}.get(args.command) or dpo_loss_fn(args.beta, args.loss_type)
    config = LoopConfig(
        steps=args.steps,
        grad_accum=args.grad_accum,
        save_every=args.save_every,
        resume=args.resume,
        out_dir=args.out,
    )
    step = sft_step if pipeline else None  # the pipeline computes sft_loss from its logits (trainer/pp.py)
    rows = train_loop(booster, model, optimizer, loader, loss_fn, config, not args.no_progress, step)
    out = Path(args.out) / "model"
    plain = booster.unwrap(model)
    if is_peft(plain):
        if dist_rank() == 0:
            export_hf(plain, tokenizer, out)
    else:
        booster.save_model(model, out)
        if dist_rank() == 0:
            tokenizer.save_pretrained(str(out))
    return rows
