"""The Ray producer-consumer GRPO engine with a tiny random Llama: fault handling.

Exact weight equality after a (multi-bucket) sync is checked at the end of the learning run in
``test_engine_learning.py``; the bucket protocol itself in ``test_weight_sync.py``.

The local Ray cluster, the tiny policy and the reward module ``chat_engine_test_rewards`` are
session fixtures of ``conftest.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from megalith.common.errors import DistributedError
from megalith_chat.algorithms import PolicyLossConfig
from megalith_chat.engine.config import EngineConfig, GRPORunConfig, PromptSource
from megalith_chat.engine.driver import GRPOEngine
from megalith_chat.metrics import read_metrics
from megalith_chat.rollout.generation import SamplingConfig
from megalith_chat.rollout.producer import RolloutConfig
from megalith_chat.trainer.grpo import LearnerConfig


def _config(model_dir: Path, out: Path, **overrides: Any) -> GRPORunConfig:
    base: dict[str, Any] = dict(
        model=str(model_dir),
        out_dir=str(out),
        prompts=PromptSource(
            task="reverse",
            reward="chat_engine_test_rewards:digits",
            num_prompts=100,
            task_options=(("min_len", 2), ("max_len", 2)),
        ),
        rollout=RolloutConfig(
            group_size=8, prompts_per_batch=16, sampling=SamplingConfig(2, 1.0), overlong="none"
        ),
        learner=LearnerConfig(loss=PolicyLossConfig(), micro_batch_size=128, track_kl=False),
        engine=EngineConfig(
            num_producers=1,
            num_consumers=2,
            max_staleness=1,
            queue_size=2,
            rollout_timeout_s=60,
            step_timeout_s=60,
            sync_timeout_s=30,
            startup_timeout_s=120,
        ),
        steps=400,
        prompts_per_step=16,
        lr=1e-2,
        eval_every=25,
        eval_prompts=100,
        export=False,
    )
    base.update(overrides)
    return GRPORunConfig(**base)


@pytest.mark.slow
def test_failing_rewards_score_zero_and_a_killed_producer_stops_the_run(
    ray_cluster: Any, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """One engine run checks both fault paths (one actor start-up instead of two).

    Rewards that raise (first digit even) or hang (first digit odd, 0.3 s limit) score 0 and are
    counted while the run goes on for 3 steps; then producer 0 is killed and the run must end
    with a ``DistributedError`` naming it (instead of hanging until a timeout).
    """

    def kill_producer(step: int, row: dict[str, float], engine: GRPOEngine) -> None:
        if step == 2:
            ray_cluster.kill(engine.producers[0])

    cfg = _config(
        tiny_model_dir,
        tmp_path,
        steps=50,
        eval_every=0,
        prompts_per_step=2,
        engine=EngineConfig(num_consumers=1, rollout_timeout_s=60, step_timeout_s=60, sync_timeout_s=30),
        prompts=PromptSource(
            task="reverse",
            reward="chat_engine_test_rewards:faulty",
            num_prompts=20,
            task_options=(("min_len", 2), ("max_len", 2)),
        ),
        rollout=RolloutConfig(
            group_size=4,
            prompts_per_batch=2,
            sampling=SamplingConfig(2, 1.0),
            overlong="none",
            dynamic_sampling=False,
            reward_timeout_s=0.3,
        ),
    )
    with pytest.raises(DistributedError, match="producer 0 died"):
        GRPOEngine(cfg, on_step=kill_producer).run()
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert sum(r["reward_errors"] for r in rows) > 0
    # every non-failing sample scores exactly 0.5, failing ones 0: the mean reflects the zeros
    means = [r["reward_mean"] for r in rows]
    assert all(0 <= m < 0.5 for m in means)
