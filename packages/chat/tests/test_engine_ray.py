"""The Ray producer-consumer GRPO engine with a tiny random Llama: learning, faults, weight sync.

One local Ray cluster (2 CPUs, loopback only) is shared by the tests of this module. The reward
functions live in a module written to a temporary folder that Ray workers import by path.
"""

from __future__ import annotations

import os
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from megalith.common.errors import DistributedError
from megalith_chat.algorithms import PolicyLossConfig
from megalith_chat.data.tasks import reverse_digits_task
from megalith_chat.engine.config import EngineConfig, GRPORunConfig, PromptSource
from megalith_chat.engine.driver import GRPOEngine
from megalith_chat.rollout.generation import SamplingConfig
from megalith_chat.rollout.producer import RolloutConfig
from megalith_chat.trainer.grpo import LearnerConfig

REWARDS = textwrap.dedent(
    """
    import time

    def digits(completion, sample):
        # fraction of the answer's digit positions reproduced (partial credit, exact = 1.0)
        got, want = completion.replace(" ", ""), str(sample["answer"])
        return sum(a == b for a, b in zip(got, want)) / len(want)

    def faulty(completion, sample):
        first = completion.replace(" ", "")[:1]
        if first in "02468" and first:
            raise RuntimeError("reward exploded")
        if first in "13579" and first:
            time.sleep(3600)
        return 0.5
    """
)
SPECIALS = ["<unk>", "<pad>", "<|user|>", "<|assistant|>", "<|end|>"]
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
ENV = {
    "RAY_AUTH_MODE": "disabled",
    "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory: pytest.TempPathFactory) -> Any:
    folder = tmp_path_factory.mktemp("rewards")
    (folder / "chat_engine_test_rewards.py").write_text(REWARDS)
    saved = {k: os.environ.get(k) for k in [*ENV, "PYTHONPATH", "HF_HOME"]}
    os.environ.update(ENV)
    os.environ["HF_HOME"] = str(tmp_path_factory.mktemp("hf_home"))
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(folder), saved["PYTHONPATH"]) if p)
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 2-layer Llama (hidden 64) and a word-level tokenizer over the reverse task's words."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("tiny_policy")
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Digits(individual_digits=True)]
    )
    corpus = [p.prompt[0]["content"] for p in reverse_digits_task(50, 0, 2, 2)] + ["0 1 2 3 4 5 6 7 8 9"]
    tok.train_from_iterator(corpus, trainer=trainers.WordLevelTrainer(special_tokens=SPECIALS))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="<|end|>"
    )
    fast.chat_template = TEMPLATE
    fast.save_pretrained(str(path))
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=fast.pad_token_id,
        eos_token_id=fast.eos_token_id,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).save_pretrained(str(path))
    return path


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
def test_weight_sync_between_actors_gives_equal_parameters(
    ray_cluster: Any, tiny_model_dir: Path, tmp_path: Path
) -> None:
    from megalith.common.utils import free_loopback_port
    from megalith_chat.engine.actors import ConsumerActor, ProducerActor
    from megalith_chat.engine.prompts import load_prompts
    from megalith_chat.rollout.weight_sync import SyncGroupSpec

    ray = ray_cluster
    cfg = _config(tiny_model_dir, tmp_path, engine=EngineConfig(num_consumers=1))
    consumer = ray.remote(num_cpus=0)(ConsumerActor).remote(
        0, 1, free_loopback_port(), str(tiny_model_dir), cfg
    )
    producer = ray.remote(num_cpus=0, max_concurrency=4)(ProducerActor).remote(
        0, str(tiny_model_dir), cfg, load_prompts(cfg.prompts)
    )
    try:
        spec = SyncGroupSpec(port=free_loopback_port(), world_size=2, bucket_mb=0.05, timeout_s=30)
        ray.get([consumer.open_sync.remote(spec), producer.open_sync.remote(spec, 1)], timeout=120)
        batch = ray.get(producer.sample.remote(), timeout=60)
        ray.get(consumer.train.remote(batch, 0), timeout=60)
        trained = ray.get(consumer.parameters.remote(), timeout=30)
        stale = ray.get(producer.parameters.remote(), timeout=30)
        assert any(not torch.equal(stale[n], p) for n, p in trained.items())
        sent, got = ray.get([consumer.send_weights.remote(1), producer.receive_weights.remote(1)], timeout=60)
        assert sent["buckets"] > 1 and sent["checksum"] == got["checksum"]
        synced = ray.get(producer.parameters.remote(), timeout=30)
        assert synced.keys() == trained.keys()
        for name, p in trained.items():
            torch.testing.assert_close(synced[name], p, atol=0, rtol=0)
    finally:
        for actor in (consumer, producer):
            ray.kill(actor)


def _greedy_accuracy(rows: list[dict[str, Any]]) -> list[float]:
    return [r["eval_accuracy"] for r in rows if "eval_accuracy" in r]


@pytest.mark.slow
def test_killed_producer_stops_the_run_with_a_clear_error(
    ray_cluster: Any, tiny_model_dir: Path, tmp_path: Path
) -> None:
    def kill_producer(step: int, row: dict[str, float], engine: GRPOEngine) -> None:
        if step == 1:
            ray_cluster.kill(engine.producers[0])

    cfg = _config(
        tiny_model_dir,
        tmp_path,
        steps=50,
        eval_every=0,
        prompts_per_step=2,
        engine=EngineConfig(num_consumers=1, rollout_timeout_s=60, step_timeout_s=60, sync_timeout_s=30),
        rollout=RolloutConfig(
            group_size=4, prompts_per_batch=2, sampling=SamplingConfig(2, 1.0), overlong="none"
        ),
    )
    with pytest.raises(DistributedError, match="producer 0 died"):
        GRPOEngine(cfg, on_step=kill_producer).run()


@pytest.mark.slow
def test_raising_and_hanging_rewards_score_zero_and_the_run_continues(
    ray_cluster: Any, tiny_model_dir: Path, tmp_path: Path
) -> None:
    cfg = _config(
        tiny_model_dir,
        tmp_path,
        steps=4,
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
    summary = GRPOEngine(cfg).run()
    assert summary.steps == 4
    errors = sum(r["reward_errors"] for r in summary.history)
    assert errors > 0
    # every non-failing sample scores exactly 0.5, failing ones 0: the mean reflects the zeros
    means = [r["reward_mean"] for r in summary.history]
    assert all(m < 0.5 for m in means) and all(m >= 0 for m in means)
