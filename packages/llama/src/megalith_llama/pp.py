"""Pipeline parallelism in the training recipe (`--pp N`): options, the training step through
`booster.execute_pipeline`, and the held-out loss through its forward-only path.

The pipeline splits each step's batch [B, S] into m microbatches [B/m, S] and returns
Σ_i criterion(y_i, mb_i) / m. The criterion here is the model's own causal-LM loss (vocabulary
parallel under tp) as a *sum* over the microbatch's labelled tokens divided by N, the labelled
tokens of the whole batch, times m:

    Σ_i (sum_i / N · m) / m = Σ_i sum_i / N = the batch's token-weighted mean loss

— exactly the loss of the unpipelined `model(**batch).loss`, even when microbatches hold different
numbers of labelled tokens (padded SFT conversations). Evaluation runs under `torch.no_grad()`,
where `execute_pipeline` only runs the forward passes, with the criterion sum_i · m (so the result
is Σ_i sum_i, the batch's summed loss); a short last batch is padded with unlabelled rows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from megalith.common.errors import ConfigError, DataError

IGNORE_INDEX = -100


def resolve_microbatches(pp: int, batch_size: int, num_microbatches: int | None) -> int:
    """`--num-microbatches` (default: 2·pp, or the batch size when smaller), checked to divide
    `--batch-size` and to give every pipeline stage a microbatch."""
    m = num_microbatches if num_microbatches is not None else min(2 * pp, batch_size)
    if m < 1 or batch_size % m:
        raise ConfigError(
            f"--num-microbatches {m} must divide --batch-size {batch_size} "
            "(every microbatch holds batch-size / num-microbatches sequences)"
        )
    if pp > 1 and m < pp:
        raise ConfigError(
            f"--num-microbatches {m} is fewer than the --pp {pp} pipeline stages "
            f"(raise --batch-size to at least {pp} or set --num-microbatches >= {pp})"
        )
    return m


def model_chunks(schedule: str) -> int:
    """Stages per pipeline rank: 2 for the interleaved and V schedules, else 1."""
    return 2 if schedule in ("interleaved", "zb-v") else 1


def check_model(config: Any, pp: int, schedule: str, lora: bool, document_masking: bool) -> None:
    """What the pipeline split cannot do, named before any weight moves."""
    if pp <= 1:
        return
    layers, stages = int(config.num_hidden_layers), pp * model_chunks(schedule)
    if layers < stages:
        raise ConfigError(
            f"--pp {pp} with --pp-schedule {schedule} needs {stages} pipeline stages of at least one "
            f"decoder layer each; the model has {layers} layers"
        )
    if lora:
        raise ConfigError("--lora cannot be combined with --pp (the stage split needs the plain HF model)")
    if document_masking:
        raise ConfigError(
            "--pp cannot train on document-masked data (per-document position ids); "
            "prepare the data without document masking"
        )


def _labelled(labels: torch.Tensor) -> int:
    """Tokens that carry a loss: labels[:, 1:] != -100 (the HF shift)."""
    return int((labels[:, 1:] != IGNORE_INDEX).sum())


def _criterion(model: Any, scale: float) -> Callable[[torch.Tensor, Any], torch.Tensor]:
    """criterion(logits, mb) = (Σ token losses of mb) · scale, through the model's loss function."""

    def criterion(logits: torch.Tensor, mb: Any) -> torch.Tensor:
        total = model.loss_function(
            logits=logits, labels=mb["labels"], vocab_size=model.config.vocab_size, num_items_in_batch=1
        )
        return total * scale

    return criterion


def train_step(booster: Any, model: Any, optimizer: Any, batch: dict[str, torch.Tensor], accum: int) -> float:
    """Forward + backward of `batch` through the pipeline; returns its mean token loss / accum (the
    quantity the unpipelined loop back-propagates)."""
    m = booster.plugin.config.num_microbatches
    n = max(_labelled(batch["labels"]), 1)
    criterion = _criterion(booster.unwrap(model), m / (n * accum))
    out = booster.execute_pipeline(iter([batch]), model, criterion, optimizer)
    return float(out["loss"])


@torch.no_grad()
def evaluate(
    booster: Any, model: Any, dataset: Dataset[Any], batch_size: int, device: torch.device
) -> tuple[float, int]:
    """(mean token loss, labelled tokens) of `dataset` through the forward-only pipeline; every
    pipeline rank of one data-parallel rank calls it with the same dataset."""
    m = booster.plugin.config.num_microbatches
    criterion = _criterion(booster.unwrap(model), float(m))
    model.eval()
    total, count = 0.0, 0
    for batch in DataLoader(dataset, batch_size=batch_size, shuffle=False):
        ids, labels = batch["input_ids"].to(device), batch["labels"].to(device)
        short = batch_size - ids.shape[0]
        if short:  # unlabelled rows fill the last batch up to a multiple of the microbatches
            ids = torch.cat([ids, ids[:1].expand(short, -1)])
            labels = torch.cat([labels, labels.new_full((short, labels.shape[1]), IGNORE_INDEX)])
        out = booster.execute_pipeline(iter([{"input_ids": ids, "labels": labels}]), model, criterion, None)
        total += float(out["loss"])
        count += _labelled(labels)
    model.train()
    if count == 0:
        raise DataError("no labelled tokens to evaluate")
    return total / count, count
