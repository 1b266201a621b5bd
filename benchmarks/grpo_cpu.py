"""GRPO step-time breakdown on CPU: the zero-argument ``chat-train`` configuration, a few steps.

    uv run python benchmarks/grpo_cpu.py                 # 3 measured steps after 1 warm-up step
    uv run python benchmarks/grpo_cpu.py --steps 5 --model path/to/hf_dir

Runs the Ray producer-consumer engine (1 producer, 2 ZeRO-2 consumer ranks, SmolLM2-135M-Instruct,
arithmetic task) with every default of ``chat-train grpo`` and reports, per step (medians over the
measured steps):

* ``generate_s``   producer: HF ``generate`` of ``prompts_per_step * G`` responses (with log-probs);
* ``logprob_s``    consumer: forward passes that recompute the response log-probs (policy + ref);
* ``backward_s``   consumer: backward of the policy loss (ZeRO-2 gradient reduction included);
* ``optimizer_s``  consumer: gradient clipping + AdamW step (+ ZeRO-2 parameter all-gather);
* ``update_s``     consumer: the whole training step on a rank;
* ``sync_s``       driver: bucketed weight broadcast consumer rank 0 -> producer (with checksums);
* ``wait_s``       driver: time spent waiting for a rollout batch (rollout not hidden by training);
* ``rollout_tokens_per_s``: generated response tokens / ``generate_s``.

Writes benchmarks/results/grpo_cpu.json (machine, versions, date).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write_result

KEYS = (
    "generate_s",
    "logprob_s",
    "backward_s",
    "optimizer_s",
    "update_s",
    "train_s",
    "sync_s",
    "wait_s",
    "rollout_tokens_per_s",
    "response_length",
    "reward_mean",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="measured steps (default: 3)")
    parser.add_argument("--warmup", type=int, default=1, help="steps excluded from the medians (default: 1)")
    parser.add_argument("--model", default="smollm2", help="'smollm2' or a local HF directory")
    args = parser.parse_args()
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    from megalith_chat.cli import build_parser
    from megalith_chat.commands import grpo_config
    from megalith_chat.engine.driver import GRPOEngine

    with tempfile.TemporaryDirectory() as out:
        argv = ["grpo", "--model", args.model, "--out", out, "--no-export", "--no-progress"]
        argv += ["--steps", str(args.steps + args.warmup)]
        config = grpo_config(build_parser().parse_args(argv))
        start = time.perf_counter()
        summary = GRPOEngine(config).run()
        wall = time.perf_counter() - start
    rows = [r for r in summary.history if r.get("step", -1) >= args.warmup]
    medians = {k: statistics.median(float(r.get(k) or 0.0) for r in rows) for k in KEYS}
    print(f"{'quantity':<22}{'median':>12}")
    for k, v in medians.items():
        print(f"{k:<22}{v:>12.3f}")
    samples = config.prompts_per_step * config.rollout.group_size
    path = write_result(
        "grpo_cpu.json",
        {
            "config": {
                "model": args.model,
                "task": config.prompts.task,
                "prompts_per_step": config.prompts_per_step,
                "group_size": config.rollout.group_size,
                "samples_per_step": samples,
                "max_new_tokens": config.rollout.sampling.max_new_tokens,
                "num_producers": config.engine.num_producers,
                "num_consumers": config.engine.num_consumers,
                "plugin": config.plugin,
                "measured_steps": len(rows),
                "warmup_steps": args.warmup,
            },
            "median_per_step": medians,
            "per_step": [{k: r.get(k) for k in ("step", *KEYS)} for r in rows],
            "wall_s_including_startup": wall,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
