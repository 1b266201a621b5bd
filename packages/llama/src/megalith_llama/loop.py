"""The training step loop of `llama-pretrain train` / `sft` (see `train.py` for the recipe around it):
micro-batches under `no_sync`, clipping, the optimizer and LR steps, metrics (loss, tokens/s, MFU),
periodic held-out evaluation and checkpoints."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from megalith.common.errors import DataError
from megalith.distributed import rank as _rank
from megalith.distributed import world_size as _world
from megalith_llama.train_utils import MetricsLog, peak_flops, prune_checkpoints

if TYPE_CHECKING:
    from megalith_llama.train_config import TrainConfig


def heldout_ppl(booster: Any, model: Any, heldout: Any, cfg: TrainConfig, device: torch.device) -> float:
    """Held-out perplexity: every data-parallel rank evaluates a disjoint slice (the ranks of one
    tensor-parallel group evaluate the same slice together); token-weighted sums are all-reduced
    (a tp group counts its slice tp times in both sums, which leaves the ratio unchanged)."""
    from torch.utils.data import Subset

    from megalith_llama.eval import evaluate

    dp_rank, dp_size = booster.plugin.dp_rank(), booster.plugin.dp_size()
    n = min(len(heldout), cfg.eval_batches * cfg.batch_size * dp_size)
    mine = Subset(heldout, list(range(dp_rank, n, dp_size)))
    if cfg.pp > 1:  # forward-only pipeline (megalith_llama/pp.py)
        from megalith_llama import pp

        loss, tokens = pp.evaluate(booster, model, mine, cfg.batch_size, device)
    else:
        result = evaluate(booster.unwrap(model), mine, batch_size=cfg.batch_size, device=device)
        loss, tokens = result.loss, result.tokens
    sums = torch.tensor([loss * tokens, float(tokens)], dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(sums)
    model.train()
    return math.exp(float(sums[0] / sums[1]))


@dataclass(frozen=True)
class Parts:
    """What `Booster.boost` returned, plus the booster."""

    booster: Any
    model: Any
    optimizer: Any
    scheduler: Any
    loader: Any
    flops_per_token: float = 0.0  # of the whole model, counted before tp / pp split it


class StepLoop:
    """The step loop: micro-batches with `no_sync`, clip, step, schedule, metrics, eval, checkpoints."""

    def __init__(
        self,
        cfg: TrainConfig,
        parts: Parts,
        metrics: MetricsLog,
        out: Path,
        heldout: Any,
        device: torch.device,
    ) -> None:
        self.cfg, self.booster, self.model, self.optimizer = cfg, parts.booster, parts.model, parts.optimizer
        self.scheduler, self.loader, self.metrics, self.out = parts.scheduler, parts.loader, metrics, out
        self.heldout, self.device = heldout, device
        self.tp = max(1, _world() // self.booster.plugin.dp_size())
        self.flops_per_token = parts.flops_per_token
        self.peak = peak_flops(device, cfg.precision)
        self._batches: Iterator[Any] = iter(())

    def _next_batch(self) -> dict[str, torch.Tensor]:
        from megalith_llama.dataset import model_inputs

        batch = next(self._batches, None)
        # A fresh iterator continues the current epoch; after a resume at an epoch's end that rest
        # can be shorter than one batch (dropped), so it yields nothing and the next one starts a
        # new epoch. A whole epoch without a batch means the data is smaller than one batch.
        for _ in range(2):
            if batch is not None:
                break
            self._batches = iter(self.loader)  # the sampler moves to the next epoch by itself
            batch = next(self._batches, None)
        if batch is None:
            raise DataError(
                f"a whole epoch of the training data gave no batch of --batch-size {self.cfg.batch_size}: "
                "this data-parallel rank has fewer samples than one batch"
            )
        dtype = next(self.model.parameters()).dtype
        inputs = model_inputs(batch, dtype)
        if "attention_mask" in batch:  # padded SFT conversations
            inputs["attention_mask"] = batch["attention_mask"]
        return {k: v.to(self.device) for k, v in inputs.items()}

    def _micro_steps(self) -> tuple[float, int]:
        total, tokens = 0.0, 0
        accum = self.cfg.grad_accum
        for micro in range(accum):
            batch = self._next_batch()
            sync = micro == accum - 1
            with self.booster.no_sync(self.model, self.optimizer) if not sync else nullcontext():
                if self.cfg.pp > 1:  # the pipeline runs forward and backward (megalith_llama/pp.py)
                    from megalith_llama.pp import train_step

                    total += train_step(self.booster, self.model, self.optimizer, batch, accum)
                else:
                    loss = self.model(**batch).loss / accum
                    self.booster.backward(loss, self.optimizer)
                    total += float(loss.detach())
            tokens += int(batch["input_ids"].numel())
        return total, tokens

    def train(self, start: int, total_steps: int) -> None:
        from tqdm import tqdm

        bar = tqdm(
            range(start, total_steps),
            initial=start,
            total=total_steps,
            disable=_rank() != 0,
            desc="train",
            unit="step",
            dynamic_ncols=True,
        )
        tokens_seen, t0 = 0, time.perf_counter()
        for step in bar:
            loss, tokens = self._micro_steps()
            # --clip 0 is off: an infinite max norm scales nothing (the norm is still measured)
            grad_norm = self.optimizer.clip_grad_by_norm(self.cfg.clip if self.cfg.clip > 0 else math.inf)
            self.optimizer.step()
            self.optimizer.zero_grad()
            lr = self.scheduler.get_last_lr()[0]
            self.scheduler.step()
            stats = torch.tensor([loss, float(tokens)], dtype=torch.float64)
            if dist.is_initialized():
                dist.all_reduce(stats)
            # every rank of a tp group saw the same tokens: count them once per dp rank
            mean_loss, global_tokens = float(stats[0]) / _world(), int(stats[1]) // self.tp
            tokens_seen += global_tokens
            elapsed = time.perf_counter() - t0
            tok_s = tokens_seen / elapsed
            mfu = (tok_s * self.flops_per_token / (self.peak * _world())) if self.peak else None
            self.metrics.write(
                {
                    "step": step + 1,
                    "loss": mean_loss,
                    "lr": lr,
                    "grad_norm": grad_norm,
                    "tokens": global_tokens,
                    "tokens_per_s": tok_s,
                    "mfu": mfu,
                }
            )
            bar.set_postfix(loss=f"{mean_loss:.4f}", tok_s=f"{tok_s:.0f}", lr=f"{lr:.2e}")
            self._periodic(step + 1, total_steps)

    def _periodic(self, step: int, total_steps: int) -> None:
        if self.cfg.eval_every and step % self.cfg.eval_every == 0 and step < total_steps:
            ppl = heldout_ppl(self.booster, self.model, self.heldout, self.cfg, self.device)
            self.metrics.write({"step": step, "event": "eval", "val_loss": math.log(ppl), "val_ppl": ppl})
        if step % self.cfg.save_every == 0 or step == total_steps:
            path = self.out / "checkpoints" / f"step_{step:08d}"
            self.booster.save_state(
                path,
                self.model,
                self.optimizer,
                self.scheduler,
                self.loader,
                step=step,
                extra={"config": _jsonable(asdict(self.cfg))},
            )
            if _rank() == 0:
                prune_checkpoints(self.out / "checkpoints", self.cfg.keep_checkpoints, newest=path)


def _jsonable(d: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(d, default=str))
