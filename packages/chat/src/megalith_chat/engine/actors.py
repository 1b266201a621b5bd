"""Ray actors of the GRPO engine: rollout producers and the consumer (trainer) ranks.

Defined as plain classes and turned into actors with ``ray.remote(...)`` by the driver, so
importing this module does not import Ray.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megalith.common.errors import ConfigError
from megalith_chat.data.datasets import PromptExample
from megalith_chat.engine.fast_rollout import make_fast_generator
from megalith_chat.engine.prompts import WeightedSum as WeightedSum  # re-exported (defined there)
from megalith_chat.engine.prompts import resolve_reward
from megalith_chat.messages import RolloutBatch, Shutdown
from megalith_chat.modeling import export_hf, is_peft, load_policy, load_tokenizer_dir
from megalith_chat.rewards import RewardRunner
from megalith_chat.rollout.generation import SamplingConfig, generate
from megalith_chat.rollout.producer import PromptStream, RolloutWorker
from megalith_chat.rollout.weight_sync import SyncGroupSpec, WeightSyncGroup, receive_weights, send_weights
from megalith_chat.trainer.grpo import GRPOLearner
from megalith_chat.trainer.parallel import full_parameters, pad_sequence_to_multiple
from megalith_chat.trainer.pp import full_parameters as pipeline_parameters
from megalith_chat.trainer.pp import pipeline_options
from megalith_chat.trainer.setup import make_booster, make_optimizer

logger = logging.getLogger(__name__)


def _set_threads(n: int) -> None:
    torch.set_num_threads(n)
    os.environ["OMP_NUM_THREADS"] = str(n)


class ProducerActor:
    """Generates rollouts in a background loop (``run``) and receives weights concurrently.

    Needs a threaded actor (``max_concurrency >= 3``): ``run`` occupies one thread for the whole
    training; ``receive_weights`` and ``stop`` arrive on others. New weights are staged by
    ``receive_weights`` and applied by the loop between two batches, so a batch is always
    generated with one consistent ``weight_version``.
    """

    def __init__(
        self, producer_id: int, model_dir: str, run: Any, prompts: Sequence[PromptExample], position: int = 0
    ) -> None:
        _set_threads(run.engine.threads_per_actor)
        torch.manual_seed(run.seed * 7919 + producer_id)
        self.producer_id, self.run_config = producer_id, run
        self.model = load_policy(model_dir, run.lora, seed=run.seed).eval()
        self.tokenizer = load_tokenizer_dir(model_dir)
        reward = resolve_reward(run.prompts.reward or run.prompts.task)
        stream = PromptStream(prompts, seed=run.seed * 31 + producer_id, position=position)
        self.fast = make_fast_generator(
            self.model,
            run.engine.rollout_engine,
            "bfloat16" if run.precision.startswith("bf16") else None,
            run.seed,
            share_prompts=run.engine.share_prompts,
        )
        self.worker = RolloutWorker(
            self.model, self.tokenizer, stream, reward, run.rollout, producer_id, generate_fn=self.fast
        )
        self.version = 0
        self._group: WeightSyncGroup | None = None
        self._pending: Any = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._running = False

    def ready(self) -> int:
        return self.producer_id

    def open_sync(self, spec: SyncGroupSpec, rank: int) -> int:
        self._group = WeightSyncGroup(spec, rank)
        return rank

    def receive_weights(self, version: int) -> dict[str, float]:
        if self._group is None:
            raise ConfigError("open_sync() must be called before receive_weights()")
        staged = receive_weights(self._group, self.model, version, trainable_only=is_peft(self.model))
        with self._lock:
            self._pending = staged
        return {
            "version": version,
            "seconds": staged.stats.seconds,
            "checksum": float(sum(staged.stats.checksums)),
        }

    def _apply_pending(self) -> None:
        with self._lock:
            staged, self._pending = self._pending, None
        if staged is not None:
            staged.apply_to(self.model)
            if self.fast is not None:
                self.fast.engine.update_weights(self.model)
            self.version = staged.stats.version

    def run(self, queue: Any, put_timeout_s: float = 1.0) -> int:
        """Produce until ``stop()``; returns the number of batches delivered."""
        from ray.util.queue import Full

        delivered = 0
        self._running = True
        while not self._stop.is_set():
            self._apply_pending()
            batch = self.worker.make_batch(self.version)
            if batch is None:
                continue
            while not self._stop.is_set():
                try:
                    queue.put(batch, timeout=put_timeout_s)
                    delivered += 1
                    break
                except Full:
                    # blocked on a full queue nothing uses the model: newer weights can be applied
                    # (the batch in hand keeps its version)
                    self._apply_pending()
        return delivered

    def sample(self) -> RolloutBatch | None:
        """One batch outside the loop (tests, debugging); applies staged weights first."""
        if self._running:
            raise ConfigError("sample() is only available while the rollout loop is not running")
        self._apply_pending()
        return self.worker.make_batch(self.version)

    def stop(self, message: Shutdown | None = None) -> str:
        self._stop.set()
        return (message or Shutdown()).reason

    def parameters(self) -> dict[str, torch.Tensor]:
        """Current parameter values (applies staged weights when the loop is not running)."""
        if not self._running:
            self._apply_pending()
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}


class ConsumerActor:
    """One data-parallel training rank: joins the consumer process group and builds the Booster."""

    def __init__(self, rank: int, world: int, port: int, model_dir: str, run: Any) -> None:
        _set_threads(run.engine.threads_per_actor)
        os.environ.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_RANK=str(rank),
        )
        self.rank, self.world, self.run_config, self.model_dir = rank, world, run, model_dir
        if world > 1:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            dist.init_process_group(
                backend, rank=rank, world_size=world, timeout=timedelta(seconds=run.engine.step_timeout_s)
            )
        torch.manual_seed(run.seed)
        model = load_policy(model_dir, run.lora, seed=run.seed)
        ref = None
        if run.lora is None and (run.learner.loss.kl_coef > 0 or run.learner.track_kl):
            import copy

            ref = copy.deepcopy(model).eval().requires_grad_(False)
        pipeline = pipeline_options(run.pp, run.pp_schedule, run.microbatches) if run.pp > 1 else None
        self.booster = make_booster(run.plugin, run.precision, run.tp, run.sp_mode, model, pipeline)
        optimizer = make_optimizer(model, run.lr, run.weight_decay)
        self.model, boosted, *_ = self.booster.boost(model, optimizer)
        assert boosted is not None  # boost() returns a BoostedOptimizer whenever it is given an optimizer
        self.optimizer = boosted
        if run.sp_mode == "split_gather":
            pad_sequence_to_multiple(self.model, run.tp)
        self.learner = GRPOLearner(self.model, self.optimizer, self.booster, run.learner, ref)
        self.tokenizer = load_tokenizer_dir(model_dir)
        self._group: WeightSyncGroup | None = None

    def ready(self) -> int:
        return self.rank

    def train(self, batch: RolloutBatch, step: int) -> dict[str, float]:
        t0 = time.perf_counter()
        metrics = self.learner.step(batch, step)
        metrics["update_s"] = time.perf_counter() - t0
        return metrics

    def open_sync(self, spec: SyncGroupSpec) -> int:
        self._group = WeightSyncGroup(spec, 0)
        return 0

    def send_weights(self, version: int) -> dict[str, float]:
        """Rank 0 sends; under tp > 1 every rank of its tp group calls this too (the tp blocks are
        gathered into full tensors, a collective), under pp > 1 every consumer rank (each stage's
        tensors are broadcast from their holder), and only rank 0 holds the sync group."""
        model = self.booster.unwrap(self.model)
        full = None
        if self.run_config.pp > 1:
            full = pipeline_parameters(self.booster, model)
        elif self.run_config.tp > 1:
            full = full_parameters(self.booster, model, is_peft(model))
        if self._group is None and full is not None:
            return {"seconds": 0.0, "bytes": 0.0, "buckets": 0.0, "checksum": 0.0}
        if self._group is None:
            raise ConfigError("open_sync() must be called before send_weights()")
        stats = send_weights(self._group, model, version, trainable_only=is_peft(model), params=full)
        return {
            "seconds": stats.seconds,
            "bytes": float(stats.num_bytes),
            "buckets": float(stats.num_buckets),
            "checksum": float(sum(stats.checksums)),
        }

    def evaluate(
        self, prompts: Sequence[PromptExample], max_new_tokens: int, prefix: str
    ) -> dict[str, float]:
        """Greedy decoding on ``prompts``: mean reward and accuracy (reward >= the accuracy threshold)."""
        run = self.run_config
        reward = resolve_reward(run.prompts.reward or run.prompts.task)
        runner = RewardRunner(timeout_s=run.rollout.reward_timeout_s)
        model = self.booster.unwrap(self.model)
        gen = generate(
            model, self.tokenizer, [p.prompt for p in prompts], 1, SamplingConfig(max_new_tokens, 0.0), prefix
        )
        scores = [runner(reward, t, p.reward_sample()).score for t, p in zip(gen.texts, prompts)]
        correct = sum(s >= run.rollout.accuracy_threshold for s in scores)
        return {"eval_reward": sum(scores) / len(scores), "eval_accuracy": correct / len(scores)}

    def save_state(self, path: str, step: int, extra: dict[str, Any]) -> str:
        self.booster.save_state(path, self.model, self.optimizer, step=step, extra=extra)
        return path

    def load_state(self, path: str) -> dict[str, Any]:
        return self.booster.load_state(path, self.model, self.optimizer)

    def export(self, path: str) -> str:
        model = self.booster.unwrap(self.model)
        if is_peft(model):
            if self.rank == 0:
                export_hf(model, self.tokenizer, path)
        else:
            self.booster.save_model(self.model, path)
            if self.rank == 0:
                self.tokenizer.save_pretrained(path)
        return path

    def parameters(self) -> dict[str, torch.Tensor]:
        model = self.booster.unwrap(self.model)
        return {n: p.detach().clone() for n, p in model.named_parameters()}

    def describe(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "world": self.world,
            "plugin": self.booster.plugin.name,
            "learner": asdict(self.run_config.learner),
        }


def run_dir(path: str | Path) -> Path:
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    return out
