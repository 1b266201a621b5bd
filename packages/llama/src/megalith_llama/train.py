"""Continual pretraining on the megalith Booster: the recipe behind `llama-pretrain train`.

    launch → load model + tokenizer → prepared data (built-in corpus by default) → boost →
    [resume] → eval before → train (accumulate, clip, step, schedule; metrics, checkpoints) →
    eval after → HF export + loss curve.

Every rank runs this; rank 0 writes metrics, plots and prints. Checkpoints go through
`Booster.save_state` (atomic, exact resume: model, optimizer, scheduler, sampler, RNG, step).
"""

from __future__ import annotations

import logging
import math
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megalith.common.errors import ConfigError
from megalith_llama.loop import Parts, StepLoop, heldout_ppl
from megalith_llama.schedule import lr_lambda
from megalith_llama.train_config import TrainConfig, kernel_names
from megalith_llama.train_utils import (
    MetricsLog,
    checkpoint_dirs,
    flops_per_token,
    latest_checkpoint,
    plot_curve,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainResult:
    output: Path
    final_model: Path
    checkpoints: Path
    metrics: Path
    plot: Path | None
    steps: int
    perplexity_before: float
    perplexity_after: float
    seconds: float


from megalith.distributed import rank as _rank  # noqa: E402


def run_training(cfg: TrainConfig) -> TrainResult:
    """Run (or resume) a training run; every rank calls this."""
    from megalith.booster import Booster
    from megalith.booster.plugins import make_plugin
    from megalith.distributed import launch

    start = time.perf_counter()
    out = Path(cfg.output)
    check_fresh_output(cfg, out)  # every rank, before any work: all refuse together
    info = launch(device=cfg.device)
    torch.manual_seed(cfg.seed + info.rank)
    if cfg.overwrite and info.rank == 0:  # the barrier in _load_inputs orders this before any save
        for old in checkpoint_dirs(out / "checkpoints"):
            shutil.rmtree(old)
    model, tokenizer, train_set, heldout = _load_inputs(cfg, info.device.torch)
    plugin = _plugin(cfg, make_plugin)
    check_data_size(len(train_set), cfg.batch_size, plugin.dp_size())
    booster = Booster(
        plugin=plugin, precision=cfg.precision, kernels=kernel_names(cfg.kernels), compile=cfg.compile
    )
    params = [p for p in model.parameters() if p.requires_grad]
    per_token = flops_per_token(model, model.config, cfg.seq_len)  # the whole model, before any split
    adamw = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    total_steps = _total_steps(cfg, plugin.dp_size())
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        adamw,
        lr_lambda(cfg.schedule, cfg.warmup_steps, total_steps, cfg.min_lr_ratio, cfg.decay_fraction),
    )
    loader = booster.prepare_dataloader(train_set, batch_size=cfg.batch_size, seed=cfg.seed)
    model, optimizer, _, loader, scheduler = booster.boost(
        model, adamw, dataloader=loader, lr_scheduler=scheduler
    )
    assert optimizer is not None  # boost() returns a BoostedOptimizer whenever it is given an optimizer
    if cfg.sft_data and cfg.neftune_alpha > 0:  # after boost: tensor parallelism swaps the embedding
        from megalith_llama.sft_data import enable_neftune

        enable_neftune(booster.unwrap(model), cfg.neftune_alpha)
    step = _maybe_resume(cfg, booster, model, optimizer, scheduler, loader, out)
    metrics = MetricsLog(out / "metrics.jsonl", enabled=info.rank == 0, truncate_after=step)
    ppl_before = heldout_ppl(booster, model, heldout, cfg, info.device.torch)
    if step == 0:
        metrics.write({"step": 0, "event": "eval", "val_loss": math.log(ppl_before), "val_ppl": ppl_before})
    parts = Parts(booster, model, optimizer, scheduler, loader, per_token)
    loop = StepLoop(cfg, parts, metrics, out, heldout, info.device.torch)
    loop.train(step, total_steps)
    ppl_after = heldout_ppl(booster, model, heldout, cfg, info.device.torch)
    metrics.write(
        {"step": total_steps, "event": "eval", "val_loss": math.log(ppl_after), "val_ppl": ppl_after}
    )
    final = _export(booster, model, tokenizer, out)
    plot = plot_curve(out / "metrics.jsonl", out / "loss.png") if info.rank == 0 else None
    return TrainResult(
        out,
        final,
        out / "checkpoints",
        out / "metrics.jsonl",
        plot,
        total_steps,
        ppl_before,
        ppl_after,
        time.perf_counter() - start,
    )


def _plugin(cfg: TrainConfig, make_plugin: Any) -> Any:
    """`--tp N` / `--pp N` (N > 1) select the hybrid plugin: tensor (and sequence) parallel inside,
    pipeline stages across, ZeRO over dp."""
    if cfg.tp == 1 and cfg.sp_mode == "none" and cfg.pp == 1:
        return make_plugin(cfg.plugin)
    stages = {"ddp": 0, "zero1": 1, "zero2": 2, "hybrid": 2}
    if cfg.plugin not in stages:
        raise ConfigError(f"--tp/--sp-mode/--pp work with --plugin {'|'.join(stages)}, not {cfg.plugin!r}")
    options: dict[str, Any] = {"tp_size": cfg.tp, "sp_mode": cfg.sp_mode, "zero_stage": stages[cfg.plugin]}
    if cfg.pp > 1:
        from megalith_llama.pp import model_chunks, resolve_microbatches

        m = resolve_microbatches(cfg.pp, cfg.batch_size, cfg.num_microbatches)
        options |= {"pp_size": cfg.pp, "pp_schedule": cfg.pp_schedule, "num_microbatches": m}
        options["num_model_chunks"] = model_chunks(cfg.pp_schedule)
    return make_plugin("hybrid", **options)


def _total_steps(cfg: TrainConfig, dp_size: int) -> int:
    """`--max-tokens` caps the steps: one step trains batch x accum x seq_len tokens on each
    data-parallel rank (the tp / pp ranks of one replica share those tokens, they add none)."""
    if cfg.max_tokens is None:
        return cfg.max_steps
    per_step = cfg.batch_size * cfg.grad_accum * cfg.seq_len * dp_size
    return min(cfg.max_steps, max(1, cfg.max_tokens // per_step))


def check_fresh_output(cfg: TrainConfig, out: Path) -> None:
    """A run without --resume starts at step 0; checkpoints of an earlier run in `out` would be
    mixed with its own (pruning and `--resume auto` pick by step), so they need --overwrite."""
    if cfg.resume is not None or cfg.overwrite:
        return
    found = checkpoint_dirs(out / "checkpoints")
    if found:
        names = ", ".join(p.name for p in found)
        raise ConfigError(
            f"--output {out} already holds checkpoints of an earlier run ({names}); pass --resume auto "
            "to continue it, --overwrite to delete them and start over, or another --output"
        )


def check_data_size(num_samples: int, batch_size: int, dp_size: int) -> None:
    """Each of the dp ranks gets num_samples // dp_size samples per epoch (the rest is dropped) and
    needs at least one full batch of them."""
    if num_samples // dp_size < batch_size:
        raise ConfigError(
            f"the training data has {num_samples} sequence(s), {num_samples // dp_size} per data-parallel "
            f"rank (dp size {dp_size}), fewer than one batch of --batch-size {batch_size}; lower "
            "--batch-size or prepare more data"
        )


def _load_inputs(cfg: TrainConfig, device: torch.device) -> tuple[Any, Any, Any, Any]:
    from megalith.distributed import barrier
    from megalith_llama.dataset import PackedDataset
    from megalith_llama.eval import heldout_sequences
    from megalith_llama.model import check_seq_len, load_model
    from megalith_llama.pp import check_model
    from megalith_llama.train_utils import prepared_builtin

    if _rank() == 0:  # first conversion of the default model happens once, on rank 0
        loaded = load_model(cfg.model, tokenizer=cfg.tokenizer, data_dir=cfg.data_dir, seed=cfg.seed)
    barrier()
    if _rank() != 0:
        loaded = load_model(cfg.model, tokenizer=cfg.tokenizer, data_dir=cfg.data_dir, seed=cfg.seed)
    model, tokenizer = loaded.model, loaded.tokenizer
    check_seq_len(model.config, cfg.seq_len)
    train_set = _train_set(cfg, model, tokenizer, prepared_builtin, PackedDataset, barrier)
    check_model(
        model.config, cfg.pp, cfg.pp_schedule, cfg.lora, bool(getattr(train_set, "document_masking", False))
    )
    heldout = heldout_sequences(tokenizer, cfg.seq_len)
    # a PEFT model with LoRA: an nn.Module, no longer a PreTrainedModel
    policy: torch.nn.Module = _apply_lora(model, cfg.lora_rank) if cfg.lora else model
    return policy.to(device), tokenizer, train_set, heldout


def _train_set(
    cfg: TrainConfig, model: Any, tokenizer: Any, prepared_builtin: Any, packed: Any, barrier: Any
) -> Any:
    """SFT conversations (`sft_data`) or packed pretraining shards (`data`, default: the built-in corpus)."""
    if cfg.sft_data:
        from megalith_llama.sft_data import SFTDataset

        return SFTDataset(cfg.sft_data, tokenizer, cfg.seq_len)
    data = (
        Path(cfg.data) if cfg.data else prepared_builtin(tokenizer, cfg.seq_len, cfg.data_dir, rank=_rank())
    )
    barrier()
    train_set = packed(data)
    train_set.check_compatible(tokenizer, model.config)
    if train_set.seq_len != cfg.seq_len:
        raise ConfigError(
            f"--seq-len {cfg.seq_len} differs from the prepared data's seq_len {train_set.seq_len} ({data})"
        )
    return train_set


def _apply_lora(model: Any, rank: int) -> Any:
    from megalith.common import require

    peft = require("peft")
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, lora_dropout=0.0)
    return peft.get_peft_model(model, config)


def _maybe_resume(
    cfg: TrainConfig, booster: Any, model: Any, optimizer: Any, scheduler: Any, loader: Any, out: Path
) -> int:
    if cfg.resume is None:
        return 0
    path = latest_checkpoint(out / "checkpoints") if cfg.resume == "auto" else Path(cfg.resume)
    if path is None:
        logger.info("--resume auto: no checkpoint under %s, starting from step 0", out / "checkpoints")
        return 0
    meta = booster.load_state(path, model, optimizer, scheduler, loader)
    logger.info("resumed from %s at step %d", path, meta["step"])
    return int(meta["step"])


def _export(booster: Any, model: Any, tokenizer: Any, out: Path) -> Path:
    """Model and tokenizer go into a staging directory that is renamed to `final/` only when both
    are written, so `final/` is either absent (or the previous export) or complete."""
    from megalith_llama.io import move_into_place

    final, staging = out / "final", out / ".final.export"
    unwrapped = booster.unwrap(model)
    if hasattr(unwrapped, "merge_and_unload"):  # LoRA: export the merged plain model
        unwrapped = unwrapped.merge_and_unload()
    booster.save_model(unwrapped, staging)  # every rank calls it; rank 0 writes
    if _rank() == 0:
        tokenizer.save_pretrained(str(staging))
        move_into_place(staging, final)
    if dist.is_initialized():
        dist.barrier()
    return final
