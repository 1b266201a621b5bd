"""The GRPO driver: starts producers and the consumer group on Ray and runs the training loop.

```
            driver (this process): loop, RolloutBuffer, metrics, checkpoints
              |  ray calls (train / send_weights / save)          ^ RolloutBatch messages
              v                                                    |
   +--------------------------+   bounded Ray queue   +----------------------------+
   | consumer rank 0 .. N-1   | <------------------- | producer 0 .. M-1           |
   | Booster(ZeRO-2), gloo/   |                       | HF generate + rewards,     |
   | NCCL default group (dp)  | == weight sync ====>  | staged weights, version v  |
   +--------------------------+  separate TCPStore   +----------------------------+
                                  group: rank 0 + producers, bucketed + checksums
```

Per step: take ``prompts_per_step`` fresh groups (staleness <= ``max_staleness``) from the
buffer, run ``train`` on every consumer rank (each takes its dp shard), bump the weight version
and broadcast the new weights from consumer rank 0 to every producer. Every wait has a timeout;
a dead or failed actor stops the run with a :class:`DistributedError` naming it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megalith.common.errors import DistributedError
from megalith.common.utils import free_loopback_port, require
from megalith_chat.data.datasets import PromptExample
from megalith_chat.engine.cluster import check_watched, kill_all, start_ray, wait_all
from megalith_chat.engine.config import GRPORunConfig
from megalith_chat.engine.prompts import eval_prompts, load_prompts
from megalith_chat.messages import RolloutBatch
from megalith_chat.metrics import MetricsWriter, plot_reward_curve, read_metrics
from megalith_chat.modeling import resolve_model
from megalith_chat.rollout.batching import RolloutBuffer
from megalith_chat.rollout.weight_sync import SyncGroupSpec

logger = logging.getLogger(__name__)

StepHook = Callable[[int, dict[str, float], "GRPOEngine"], bool | None]
CHECKPOINT = "checkpoint"


@dataclass(frozen=True)
class RunSummary:
    """What a finished run produced, with the headline numbers."""

    out_dir: str
    steps: int
    wall_s: float
    metrics_path: str
    plot_path: str | None
    model_dir: str | None
    history: list[dict[str, Any]] = field(default_factory=list)

    def mean_reward(self, first: bool, n: int = 5) -> float:
        rows = [r["reward_mean"] for r in self.history if r.get("reward_mean") is not None]
        part = rows[:n] if first else rows[-n:]
        return sum(part) / max(len(part), 1)


class GRPOEngine:
    """One distributed GRPO run (see module docstring).

    ``on_step(step, metrics, engine)`` is called after each step; returning ``True`` ends the run early.
    """

    def __init__(
        self, config: GRPORunConfig, on_step: StepHook | None = None, progress: bool = False
    ) -> None:
        self.config, self.on_step, self.progress = config, on_step, progress
        self.out = Path(config.out_dir)
        self.producers: list[Any] = []
        self.consumers: list[Any] = []
        self.loops: dict[str, Any] = {}
        self.queue: Any = None
        self.version = 0
        self.positions: dict[int, int] = {}

    # -- setup ---------------------------------------------------------------------------------
    def _start_actors(self, model_dir: str, positions: dict[int, int], prompts: list[PromptExample]) -> None:
        ray = require("ray")
        from ray.util.queue import Queue

        from megalith_chat.engine.actors import ConsumerActor, ProducerActor

        cfg, eng = self.config, self.config.engine
        producer_cls = ray.remote(num_cpus=0, max_concurrency=4)(ProducerActor)
        consumer_cls = ray.remote(num_cpus=0, max_concurrency=2)(ConsumerActor)
        self.queue = Queue(maxsize=eng.queue_size, actor_options={"num_cpus": 0})
        port = free_loopback_port()
        self.consumers = [
            consumer_cls.options(name=None).remote(r, eng.num_consumers, port, model_dir, cfg)
            for r in range(eng.num_consumers)
        ]
        self.producers = [
            producer_cls.remote(i, model_dir, cfg, prompts, positions.get(i, 0))
            for i in range(eng.num_producers)
        ]
        refs = {f"consumer rank {i}": c.ready.remote() for i, c in enumerate(self.consumers)}
        refs.update({f"producer {i}": p.ready.remote() for i, p in enumerate(self.producers)})
        wait_all(refs, eng.startup_timeout_s, what="start-up")
        spec = SyncGroupSpec(
            port=free_loopback_port(),
            world_size=1 + eng.num_producers,
            timeout_s=eng.sync_timeout_s,
            bucket_mb=eng.sync_bucket_mb,
            backend="nccl" if _cuda() else "gloo",
        )
        refs = {"consumer rank 0": self.consumers[0].open_sync.remote(spec)}
        refs.update({f"producer {i}": p.open_sync.remote(spec, i + 1) for i, p in enumerate(self.producers)})
        wait_all(refs, eng.startup_timeout_s, what="opening the weight-sync group")

    def _start_loops(self) -> None:
        self.loops = {f"producer {i}": p.run.remote(self.queue) for i, p in enumerate(self.producers)}

    # -- one step ------------------------------------------------------------------------------
    def _next_batch(self, buffer: RolloutBuffer, produced: list[dict[str, float]]) -> RolloutBatch:
        from ray.util.queue import Empty

        deadline = time.monotonic() + self.config.engine.rollout_timeout_s
        while True:
            batch = buffer.pop(self.version)
            if batch is not None:
                return batch
            check_watched(self.loops)
            if time.monotonic() > deadline:
                raise DistributedError(
                    f"no rollout batch within {self.config.engine.rollout_timeout_s:.0f}s "
                    f"(producers alive: {sorted(self.loops)})"
                )
            try:
                got = self.queue.get(timeout=0.5)
            except Empty:
                continue
            produced.append({**got.metrics, "reward_errors": float(got.reward_errors)})
            pid = got.producer_id
            self.positions[pid] = max(self.positions.get(pid, 0), int(got.metrics.get("prompt_position", 0)))
            buffer.add(got, self.version)

    def _sync(self) -> dict[str, float]:
        eng = self.config.engine
        refs = {"consumer rank 0 (send)": self.consumers[0].send_weights.remote(self.version)}
        # the rest of rank 0's tp group gathers the full tensors with it; under pp every consumer
        # rank takes part (each stage's tensors are broadcast from the rank that holds them)
        helpers = self.config.engine.num_consumers if self.config.pp > 1 else self.config.tp
        for i in range(1, helpers):
            refs[f"consumer rank {i} (gather)"] = self.consumers[i].send_weights.remote(self.version)
        refs.update(
            {f"producer {i}": p.receive_weights.remote(self.version) for i, p in enumerate(self.producers)}
        )
        out = wait_all(refs, eng.sync_timeout_s, watch=self.loops, what=f"weight sync v{self.version}")
        sent = out["consumer rank 0 (send)"]
        for name, got in out.items():
            if name.startswith("producer") and got["checksum"] != sent["checksum"]:
                raise DistributedError(f"{name} received weights v{self.version} with a different checksum")
        return sent

    def _train(self, batch: RolloutBatch, step: int) -> dict[str, float]:
        ray = require("ray")
        ref = ray.put(batch)
        refs = {f"consumer rank {i}": c.train.remote(ref, step) for i, c in enumerate(self.consumers)}
        out = wait_all(
            refs, self.config.engine.step_timeout_s, watch=self.loops, what=f"training step {step}"
        )
        return out["consumer rank 0"]

    def _step(self, step: int, buffer: RolloutBuffer) -> dict[str, float]:
        produced: list[dict[str, float]] = []
        t0 = time.perf_counter()
        batch = self._next_batch(buffer, produced)
        t1 = time.perf_counter()
        learner = self._train(batch, step)
        t2 = time.perf_counter()
        self.version += 1
        sync = self._sync()
        t3 = time.perf_counter()
        row = _rollout_metrics(produced, batch)
        row.update({k: v for k, v in learner.items()})
        row.update(
            step=step,
            weight_version=self.version,
            staleness=float(self.version - 1 - batch.weight_version),
            wait_s=t1 - t0,
            train_s=t2 - t1,
            sync_s=t3 - t2,
            sync_send_s=sync["seconds"],
            sync_buckets=sync["buckets"],
            sync_bytes=sync["bytes"],
            dropped_stale_groups=float(buffer.dropped_stale),
        )
        return row

    # -- checkpoints, evaluation ------------------------------------------------------------------
    def save(self, step: int) -> Path:
        path = self.out / CHECKPOINT
        extra = {"weight_version": self.version, "positions": {str(k): v for k, v in self.positions.items()}}
        refs = {
            f"consumer rank {i}": c.save_state.remote(str(path), step, extra)
            for i, c in enumerate(self.consumers)
        }
        wait_all(refs, self.config.engine.step_timeout_s, what="saving the checkpoint")
        return path

    def evaluate(self) -> dict[str, float]:
        cfg = self.config
        prompts = eval_prompts(cfg.prompts, cfg.eval_prompts)
        args = (prompts, cfg.rollout.sampling.max_new_tokens, cfg.rollout.response_prefix)
        # under tp > 1 the ranks of consumer rank 0's tp group generate together
        refs = {f"consumer rank {i}": self.consumers[i].evaluate.remote(*args) for i in range(cfg.tp)}
        return wait_all(refs, cfg.engine.step_timeout_s, what="evaluation")["consumer rank 0"]

    def _resume(self) -> int:
        path = self.out / CHECKPOINT
        refs = {f"consumer rank {i}": c.load_state.remote(str(path)) for i, c in enumerate(self.consumers)}
        meta = wait_all(refs, self.config.engine.step_timeout_s, what="loading the checkpoint")[
            "consumer rank 0"
        ]
        self.version = int(meta["extra"]["weight_version"])
        logger.warning("resumed from %s at step %d (weight version %d)", path, meta["step"], self.version)
        return int(meta["step"])

    def _checkpoint_positions(self) -> tuple[dict[int, int], bool]:
        from megalith.checkpoint import read_json

        state = self.out / CHECKPOINT / "state.json"
        if not (self.config.resume and state.is_file()):
            return {}, False
        extra = read_json(state).get("extra", {})
        return {int(k): int(v) for k, v in extra.get("positions", {}).items()}, True

    # -- the run -----------------------------------------------------------------------------------
    def run(self) -> RunSummary:
        cfg = self.config
        start = time.perf_counter()
        self.out.mkdir(parents=True, exist_ok=True)
        model_dir = str(resolve_model(cfg.model, cfg.data_dir))
        prompts = load_prompts(cfg.prompts)  # a bad prompts file fails here, before Ray starts
        started = start_ray(cfg.engine.ray_address, cfg.engine.num_cpus)
        try:
            positions, resuming = self._checkpoint_positions()
            self.positions = dict(positions)
            self._start_actors(model_dir, positions, prompts)
            first = self._resume() + 1 if resuming else 0
            if resuming:
                self._sync()
            self._start_loops()
            return self._loop(first, start)
        finally:
            self._shutdown(started)

    def _loop(self, first: int, start: float) -> RunSummary:
        cfg = self.config
        writer = MetricsWriter.from_step(self.out / "metrics.jsonl", first)
        buffer = RolloutBuffer(cfg.prompts_per_step, cfg.engine.max_staleness)
        bar = _progress(cfg.steps, first) if self.progress else None
        try:
            if cfg.eval_every and first == 0:
                writer.write({"step": -1, **self.evaluate()})
            for step in range(first, cfg.steps):
                row = self._step(step, buffer)
                if cfg.eval_every and (step + 1) % cfg.eval_every == 0:
                    row.update(self.evaluate())
                writer.write(row)
                if bar is not None:
                    bar.set_postfix_str(_postfix(row), refresh=False)
                    bar.update(1)
                if cfg.save_every and (step + 1) % cfg.save_every == 0:
                    self.save(step)
                if self.on_step is not None and self.on_step(step, row, self):
                    break  # the hook asked to stop early
        finally:
            writer.close()
            if bar is not None:
                bar.close()
        return self._finish(writer, start)

    def _finish(self, writer: MetricsWriter, start: float) -> RunSummary:
        cfg = self.config
        model_dir = None
        if cfg.export:
            path = str(self.out / "model")
            refs = {f"consumer rank {i}": c.export.remote(path) for i, c in enumerate(self.consumers)}
            wait_all(refs, cfg.engine.step_timeout_s, what="exporting the model")
            model_dir = path
        history = read_metrics(writer.path)  # the whole run, also the steps before a resume
        rows = [r for r in history if r.get("step", -1) >= 0]
        plot = str(plot_reward_curve(rows, self.out / "reward_curve.png")) if rows else None
        return RunSummary(
            str(self.out),
            len(rows),
            time.perf_counter() - start,
            str(writer.path),
            plot,
            model_dir,
            history,
        )

    def _shutdown(self, started: bool) -> None:
        for p in self.producers:
            try:
                p.stop.remote()
            except Exception as exc:  # noqa: BLE001 - best effort: the actor may be dead already
                logger.debug("stop: %s", exc)
        handles = [*self.producers, *self.consumers]
        if self.queue is not None:
            handles.append(self.queue.actor)
        kill_all(handles)
        if started:
            require("ray").shutdown()


def _cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def _rollout_metrics(produced: list[dict[str, float]], batch: RolloutBatch) -> dict[str, float]:
    """Sample-weighted means of the producers' metrics for the batches received this step."""
    rows = produced or [dict(batch.metrics)]
    total = sum(r.get("samples", 0.0) for r in rows) or 1.0
    keys = (
        "reward_mean",
        "reward_std",
        "accuracy",
        "response_length",
        "truncated_frac",
        "rollout_tokens_per_s",
    )
    out = {k: sum(r.get(k, 0.0) * r.get("samples", 0.0) for r in rows) / total for k in keys}
    out["generate_s"] = sum(r.get("generate_s", 0.0) for r in rows)
    out["groups_dropped"] = sum(r.get("groups_dropped", 0.0) for r in rows)
    out["reward_errors"] = sum(r.get("reward_errors", 0.0) for r in rows)
    out["batch_reward_mean"] = float(batch.rewards.mean())
    return out


def _progress(total: int, initial: int) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc="grpo", unit="step", dynamic_ncols=True)


def _postfix(row: dict[str, float]) -> str:
    return (
        f"reward {row.get('reward_mean', 0):.3f}±{row.get('reward_std', 0):.2f} acc {row.get('accuracy', 0):.2f} "
        f"len {row.get('response_length', 0):.1f} kl {row.get('kl', 0):.4f} "
        f"tok/s {row.get('rollout_tokens_per_s', 0):.0f} sync {row.get('sync_s', 0):.2f}s "
        f"stale {row.get('staleness', 0):.0f}"
    )
