"""The GRPO learner: one optimizer step on a :class:`~megalith_chat.messages.RolloutBatch`.

Per step, with ``B = num_prompts * G`` rows and ``dp`` data-parallel ranks:

1. advantages on the whole batch: ``A = grpo_advantages(r, G)`` (or Dr.GRPO / RLOO), ``[B]``;
   with ``shuffle_advantages`` they are randomly permuted -- a negative control that must not learn;
2. rank ``k`` takes rows ``[k B/dp, (k+1) B/dp)`` and splits them into micro-batches;
3. per micro-batch: ``logp = log pi_theta(y_t)`` (one forward, logits / temperature), the
   behaviour log-probs ``logp_old`` = the producer's rollout log-probs, the PPO-clip loss of
   :func:`~megalith_chat.algorithms.policy_loss` (+ ``kl_coef`` * k3-KL to the frozen reference),
   rescaled so that the sum over micro-batches and the dp gradient *average* equal the gradient of
   the loss aggregated over the global batch; backward under ``booster.no_sync`` except the last;
4. clip the global gradient norm, optimizer step.

Pure torch + the megalith Booster: no Ray here, so a step is testable under ``run_distributed``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megalith.booster import Booster
from megalith.common.errors import ConfigError
from megalith_chat.algorithms import (
    IGNORE_INDEX,
    PolicyLossConfig,
    dr_grpo_advantages,
    grpo_advantages,
    kl_estimate,
    masked_mean,
    policy_loss,
    rloo_advantages,
    token_logprobs,
)
from megalith_chat.messages import RolloutBatch
from megalith_chat.rollout.batching import select_rows
from megalith_chat.rollout.generation import response_logprobs
from megalith_chat.trainer.pp import is_pipelined, num_microbatches, share_from_last_stage
from megalith_chat.trainer.setup import all_reduce_mean, dp_info, shard_bounds

ADVANTAGES = {"grpo": grpo_advantages, "dr_grpo": dr_grpo_advantages, "rloo": rloo_advantages}


@dataclass(frozen=True)
class LearnerConfig:
    """How a rollout batch becomes one optimizer step (see module docstring)."""

    loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    advantage: str = "grpo"
    micro_batch_size: int = 8
    max_grad_norm: float = 1.0
    temperature: float = 1.0
    shuffle_advantages: bool = False
    track_kl: bool = True

    def __post_init__(self) -> None:
        if self.advantage not in ADVANTAGES:
            raise ConfigError(
                f"unknown advantage estimator {self.advantage!r}; expected {sorted(ADVANTAGES)}"
            )
        if self.micro_batch_size < 1:
            raise ConfigError(f"micro_batch_size must be >= 1, got {self.micro_batch_size}")
        if not self.max_grad_norm > 0:  # NaN fails too
            raise ConfigError(f"max_grad_norm must be > 0, got {self.max_grad_norm}")


def compute_advantages(batch: RolloutBatch, config: LearnerConfig, step: int) -> torch.Tensor:
    """Sequence advantages ``[B]``; the negative control permutes them with a step-seeded generator."""
    adv = ADVANTAGES[config.advantage](batch.rewards, batch.group_size)
    if config.shuffle_advantages:
        perm = torch.randperm(adv.numel(), generator=torch.Generator().manual_seed(10_007 + step))
        adv = adv[perm]
    return adv


def _denominator(mask: torch.Tensor, mode: str) -> torch.Tensor:
    """What ``aggregate_loss`` divides by: tokens (token-mean) or non-empty sequences (seq-* modes)."""
    m = mask.float()
    return m.sum() if mode == "token-mean" else (m.sum(dim=-1) > 0).float().sum()


class GRPOLearner:
    """Consumer side of GRPO: holds the boosted policy, the optimizer and the reference model."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: Any,
        booster: Booster,
        config: LearnerConfig,
        ref_model: nn.Module | None = None,
    ) -> None:
        self.model, self.optimizer, self.booster, self.config = model, optimizer, booster, config
        self.ref_model = ref_model
        self._times: dict[str, float] = {}
        self.dp_rank, self.dp_size, self.dp_group = dp_info(booster)
        if config.loss.kl_coef > 0 and ref_model is None and not self._has_adapter():
            raise ConfigError(f"kl_coef={config.loss.kl_coef} needs a reference model")

    def _has_adapter(self) -> bool:
        return hasattr(self.booster.unwrap(self.model), "disable_adapter")

    @torch.no_grad()
    def _ref_logprobs(self, rows: dict[str, torch.Tensor]) -> torch.Tensor | None:
        args = (rows["prompt_ids"], rows["prompt_mask"], rows["response_ids"], rows["response_mask"])
        if self.ref_model is not None:
            return response_logprobs(self.ref_model, *args, temperature=self.config.temperature)
        disable_adapter = getattr(self.booster.unwrap(self.model), "disable_adapter", None)
        if disable_adapter is not None:  # a PEFT model: the reference is the base without the adapter
            with disable_adapter():
                return response_logprobs(self.model, *args, temperature=self.config.temperature)
        return None

    def _global_denominator(self, mask: torch.Tensor) -> float:
        d = _denominator(mask, self.config.loss.agg_mode).double()
        if dist.is_initialized() and self.dp_size > 1:
            dist.all_reduce(d, group=self.dp_group)
        return max(float(d), 1.0)

    def step(self, batch: RolloutBatch, step: int = 0) -> dict[str, float]:
        """One optimizer step on the full batch (every dp rank receives the same batch)."""
        adv = compute_advantages(batch, self.config, step)
        lo, hi = shard_bounds(batch.num_samples, self.dp_rank, self.dp_size)
        rows = select_rows(batch, lo, hi)
        adv = adv[lo:hi]
        denom = self._global_denominator(rows["response_mask"])
        self._times = {"logprob_s": 0.0, "backward_s": 0.0}
        if is_pipelined(self.booster):
            sums = self._pipeline_step(rows, adv, denom)
        else:
            sums = self._micro_steps(rows, adv, denom)
        t0 = time.perf_counter()
        grad_norm = float(self.optimizer.clip_grad_by_norm(self.config.max_grad_norm))
        self.optimizer.step()
        self.optimizer.zero_grad()
        self._times["optimizer_s"] = time.perf_counter() - t0
        tokens = max(float(rows["response_mask"].sum()), 1.0)
        # timings (seconds on this rank) are averaged over ranks like the token-weighted metrics
        metrics = all_reduce_mean({**{k: v / tokens for k, v in sums.items()}, **self._times}, self.dp_group)
        metrics["grad_norm"] = grad_norm
        return metrics

    def _micro_steps(
        self, rows: dict[str, torch.Tensor], adv: torch.Tensor, denom: float
    ) -> dict[str, float]:
        """Forward + backward per micro-batch (no_sync except the last); token-weighted metric sums."""
        mb = self.config.micro_batch_size
        starts = list(range(0, len(adv), mb))
        sums: dict[str, float] = {}
        for i, s in enumerate(starts):
            micro = {k: v[s : s + mb] for k, v in rows.items()}
            if i < len(starts) - 1:
                with self.booster.no_sync(self.model, self.optimizer):
                    out = self._micro_step(micro, adv[s : s + mb], denom)
            else:
                out = self._micro_step(micro, adv[s : s + mb], denom)
            weight = float(micro["response_mask"].sum())
            for k, v in out.items():
                sums[k] = sums.get(k, 0.0) + v * weight
        return sums

    def _pipeline_step(
        self, rows: dict[str, torch.Tensor], adv: torch.Tensor, denom: float
    ) -> dict[str, float]:
        """The same update through `booster.execute_pipeline` (trainer/pp.py): one pipeline step over
        this rank's rows; each microbatch's criterion is its `_micro_step` loss times M (the pipeline
        averages over its M microbatches). Token-weighted metric sums, shared from the last stage."""
        cfg, m = self.config, num_microbatches(self.booster)
        t0 = time.perf_counter()
        batch = pipeline_batch(rows, adv)
        if cfg.loss.kl_coef > 0 or cfg.track_kl:
            mb = cfg.micro_batch_size
            chunks = [{k: v[s : s + mb] for k, v in rows.items()} for s in range(0, len(adv), mb)]
            refs = [self._ref_logprobs(c) for c in chunks]
            if all(r is not None for r in refs):
                batch["ref"] = torch.cat(refs)  # type: ignore[arg-type]
        t1 = time.perf_counter()
        sums: dict[str, float] = {}
        p = rows["prompt_ids"].shape[1]

        def criterion(logits: torch.Tensor, mb: dict[str, torch.Tensor]) -> torch.Tensor:
            logits = logits[:, p - 1 : -1].float()
            logits = logits / cfg.temperature if cfg.temperature > 0 else logits
            mask = mb["response_mask"].float()
            labels = torch.where(mask.bool(), mb["response_ids"], IGNORE_INDEX)
            loss, metrics = self._loss(token_logprobs(logits, labels), mb, mb.get("ref"), denom)
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + v * float(mask.sum())
            return loss * m

        self.booster.execute_pipeline(iter([batch]), self.model, criterion, self.optimizer)
        self._times["logprob_s"] += t1 - t0  # the reference forward; the policy's runs in the pipeline
        self._times["backward_s"] += time.perf_counter() - t1
        return dict(share_from_last_stage(self.booster, sums))

    def _micro_step(
        self, micro: dict[str, torch.Tensor], adv: torch.Tensor, denom: float
    ) -> dict[str, float]:
        cfg = self.config
        t0 = time.perf_counter()
        ref = self._ref_logprobs(micro) if (cfg.loss.kl_coef > 0 or cfg.track_kl) else None
        logp = response_logprobs(
            self.model,
            micro["prompt_ids"],
            micro["prompt_mask"],
            micro["response_ids"],
            micro["response_mask"],
            temperature=cfg.temperature,
        )
        t1 = time.perf_counter()
        micro = {**micro, "adv": adv}
        loss, metrics = self._loss(logp, micro, ref, denom)
        self.booster.backward(loss, self.optimizer)
        self._times["logprob_s"] += t1 - t0  # forward passes: policy (with graph) and reference
        self._times["backward_s"] += time.perf_counter() - t1
        return metrics

    def _loss(
        self, logp: torch.Tensor, micro: dict[str, torch.Tensor], ref: torch.Tensor | None, denom: float
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """The micro-batch's policy loss, rescaled to (micro sum) / (global denominator) times dp (so
        that the optimizer's gradient average over ranks recovers the global mean), and its metrics."""
        cfg = self.config
        mask = micro["response_mask"].float().to(logp.device)
        old = micro["rollout_logprobs"].to(logp.device)
        result = policy_loss(
            cfg.loss,
            logp,
            old,
            micro["adv"].to(logp.device),
            mask,
            ref_logprobs=ref.to(logp.device) if ref is not None else None,
            rollout_logprobs=old,
        )
        scale = float(_denominator(mask, cfg.loss.agg_mode).clamp(min=1.0)) / denom * self.dp_size
        metrics = dict(result.metrics)
        if ref is not None and "kl" not in metrics:
            metrics["kl"] = float(masked_mean(kl_estimate(logp.detach(), ref.to(logp.device)), mask))
        metrics["mismatch_kl"] = float(masked_mean(kl_estimate(old, logp.detach(), "k3"), mask))
        return result.loss * scale, metrics


def pipeline_batch(rows: dict[str, torch.Tensor], adv: torch.Tensor) -> dict[str, torch.Tensor]:
    """One pipeline step's inputs: ``[prompt | response]`` ids, mask and position ids (``cumsum − 1``,
    as ``response_logprobs``) plus what the loss reads, every tensor split along dim 0."""
    attn = torch.cat([rows["prompt_mask"], rows["response_mask"]], dim=1)
    return {
        "input_ids": torch.cat([rows["prompt_ids"], rows["response_ids"]], dim=1),
        "attention_mask": attn,
        "position_ids": (attn.long().cumsum(-1) - 1).clamp(min=0),
        "response_ids": rows["response_ids"],
        "response_mask": rows["response_mask"],
        "rollout_logprobs": rows["rollout_logprobs"],
        "adv": adv,
    }
