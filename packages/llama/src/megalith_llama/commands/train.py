"""`train` (the default command): continual pretraining on the megalith Booster."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from megalith.common.errors import CheckpointError, ConfigError, DataError
from megalith_llama.train_config import TrainConfig, defaults

HELP = "continual pretraining (default: SmolLM2-135M-Instruct on Python's own docs, 2 CPU ranks, ZeRO-2)"


def add_training_flags(p: argparse.ArgumentParser, output: str) -> None:
    """Flags shared by `train` and `sft`."""
    d = defaults()
    p.add_argument(
        "--model", default=None, help="'smollm2' (default), a tiny config name, an HF directory or .gguf"
    )
    p.add_argument("--tokenizer", default=None, help="tokenizer override (default: the model's own)")
    p.add_argument(
        "--output",
        default=output,
        help=f"run directory: checkpoints, final model, metrics (default {output})",
    )
    p.add_argument("--plugin", default=d.plugin, help="parallelism plugin: ddp, zero1, zero2 (default zero2)")
    p.add_argument(
        "--nproc-per-node",
        type=int,
        default=None,
        help="processes to launch on this machine (default: 1 with CUDA, else 2); "
        "re-launches through torch.distributed.run; under torchrun it joins",
    )
    p.add_argument(
        "--precision",
        default=d.precision,
        choices=["fp32", "bf16", "fp16", "bf16-true"],
        help="training precision: bf16/fp16 keep fp32 master weights, bf16-true keeps everything in "
        "bf16 (half the model-state memory; ddp and zero1/zero2 only)",
    )
    p.add_argument("--lr", type=float, default=d.lr, help=f"peak learning rate (default {d.lr})")
    p.add_argument(
        "--min-lr-ratio", type=float, default=d.min_lr_ratio, help="final LR as a fraction of the peak"
    )
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps, help="linear warmup steps")
    p.add_argument(
        "--schedule",
        default=d.schedule,
        choices=["cosine", "wsd", "constant"],
        help="LR schedule after warmup: cosine decay, warmup-stable-decay, or constant",
    )
    p.add_argument(
        "--decay-fraction", type=float, default=d.decay_fraction, help="wsd: fraction of steps spent decaying"
    )
    p.add_argument("--weight-decay", type=float, default=d.weight_decay, help="AdamW weight decay")
    p.add_argument(
        "--grad-accum", type=int, default=d.grad_accum, help="micro-batches accumulated per optimizer step"
    )
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="sequences per rank per micro-batch")
    p.add_argument("--seq-len", type=int, default=d.seq_len, help="tokens per sequence")
    p.add_argument("--max-steps", type=int, default=d.max_steps, help="optimizer steps")
    p.add_argument(
        "--max-tokens", type=int, default=None, help="stop after this many tokens (caps --max-steps)"
    )
    p.add_argument(
        "--clip",
        type=float,
        default=d.clip,
        help=f"clip the global gradient norm to this value (default {d.clip}; 0 turns clipping off)",
    )
    p.add_argument(
        "--save-every", type=int, default=d.save_every, help="checkpoint every N steps (and at the end)"
    )
    p.add_argument(
        "--keep-checkpoints",
        type=int,
        default=d.keep_checkpoints,
        help=f"newest checkpoints kept on disk, >= 1 (default {d.keep_checkpoints})",
    )
    p.add_argument(
        "--resume", default=None, help="'auto' (latest checkpoint in --output, if any) or a checkpoint path"
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="start from step 0 even if --output holds checkpoints of an earlier run, deleting them "
        "(without it, such a run is refused; use --resume auto to continue it instead)",
    )
    p.add_argument(
        "--eval-every",
        type=int,
        default=d.eval_every,
        help="held-out loss every N steps (0: only before/after)",
    )
    p.add_argument(
        "--eval-batches", type=int, default=d.eval_batches, help="held-out batches per rank per evaluation"
    )
    p.add_argument(
        "--tp", type=int, default=1, help="tensor-parallel degree (>1 uses the hybrid plugin; ZeRO over dp)"
    )
    p.add_argument(
        "--sp-mode",
        default="none",
        choices=["none", "split_gather", "all_to_all"],
        help="sequence parallelism on the tp group: Megatron-SP (split_gather) or Ulysses (all_to_all)",
    )
    p.add_argument(
        "--pp",
        type=int,
        default=1,
        help="pipeline-parallel stages (>1 uses the hybrid plugin: decoder layers split over pp ranks, "
        "embedding on the first, norm + LM head on the last; world = dp x pp x tp)",
    )
    p.add_argument(
        "--pp-schedule",
        default=d.pp_schedule,
        choices=["gpipe", "1f1b", "interleaved", "zb-h1", "zb-v"],
        help=f"pipeline schedule (default {d.pp_schedule}); interleaved and zb-v put 2 stages on each rank",
    )
    p.add_argument(
        "--num-microbatches",
        type=int,
        default=None,
        help="microbatches per pipeline step; must divide --batch-size and be >= --pp "
        "(default: 2 x pp, or the batch size when smaller)",
    )
    p.add_argument(
        "--kernels",
        default=d.kernels,
        help="fused kernels swapped into the model: none (default), all, or a comma list of "
        "rms_norm, rope, swiglu, cross_entropy, qkv (Triton on GPU, torch fallbacks on CPU; "
        "needs --tp 1 --pp 1, no --lora)",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the model (the first steps include compilation time)",
    )
    p.add_argument("--lora", action="store_true", help="train LoRA adapters (peft) instead of all weights")
    p.add_argument("--lora-rank", type=int, default=d.lora_rank, help="LoRA rank")
    p.add_argument("--seed", type=int, default=d.seed, help="random seed")
    p.add_argument("--device", default="auto", help="cpu, cuda, or auto (default)")


def register(sub: argparse._SubParsersAction, parent: argparse.ArgumentParser) -> None:
    p = sub.add_parser("train", parents=[parent], help=HELP, description=HELP)
    add_training_flags(p, "runs/llama-pretrain")
    p.add_argument(
        "--data",
        default=None,
        help="a `prepare` output directory (default: the built-in corpus, prepared once)",
    )
    p.set_defaults(func=run)


def default_nproc(device: str) -> int:
    if device == "cpu":
        return 2
    import torch

    return 1 if torch.cuda.is_available() else 2


def relaunch_if_needed(args: argparse.Namespace) -> int | None:
    """Re-run this command under torch.distributed.run when more than one process is wanted."""
    from megalith.distributed import relaunch, under_launcher

    nproc = args.nproc_per_node if args.nproc_per_node is not None else default_nproc(args.device)
    if nproc < 1:
        raise ConfigError(f"--nproc-per-node must be >= 1, got {nproc}")
    if nproc > 1 and not under_launcher():
        return relaunch(nproc, [args.command, *_argv_after_command(args)], module="megalith_llama.cli")
    return None


def _argv_after_command(args: argparse.Namespace) -> list[str]:
    """The flags after the command name, as given to `main` (which records them in ``args.argv``)."""
    argv: list[str] = args.argv
    return argv[argv.index(args.command) + 1 :]


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    names = set(TrainConfig.__dataclass_fields__) - {"extra"}
    return TrainConfig(**{k: v for k, v in vars(args).items() if k in names})


def check_inputs(cfg: TrainConfig) -> None:
    """What the ranks would read first, checked before they start: --model (a built-in name or an
    existing path), --data (a `prepare` output), the SFT file and a --resume checkpoint (present)."""
    from megalith_llama.dataset import load_manifest
    from megalith_llama.model import check_model_source

    if cfg.model:
        check_model_source(cfg.model)
    if cfg.data:
        load_manifest(cfg.data)
    if cfg.sft_data and not Path(cfg.sft_data).is_file():
        raise DataError(f"SFT file not found: {cfg.sft_data}")
    if cfg.resume not in (None, "auto") and not Path(cfg.resume).exists():
        raise CheckpointError(f"checkpoint {cfg.resume} does not exist")


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)  # bad flags fail here, before any rank is started
    from megalith_llama.train import check_fresh_output, run_training

    check_fresh_output(cfg, Path(cfg.output))  # so does an --output holding an earlier run
    check_inputs(cfg)
    code = relaunch_if_needed(args)
    if code is not None:
        return code

    result = run_training(cfg)
    if int(os.environ.get("RANK", "0")) == 0:
        print_summary(result)
    return 0


def print_summary(result: object) -> None:
    r = result
    lines = [
        f"done: {r.steps} steps in {r.seconds:.0f} s",  # type: ignore[attr-defined]
        f"held-out perplexity: {r.perplexity_before:.3f} -> {r.perplexity_after:.3f}",  # type: ignore[attr-defined]
        f"checkpoints:   {r.checkpoints}",  # type: ignore[attr-defined]
        f"final model:   {r.final_model}",  # type: ignore[attr-defined]
        f"metrics:       {r.metrics}",  # type: ignore[attr-defined]
        f"loss curve:    {r.plot}",  # type: ignore[attr-defined]
    ]
    print("\n".join(lines), flush=True)
