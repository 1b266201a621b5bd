"""Validation loss and perplexity of a causal LM on packed held-out sequences (single process).

loss = sum over learned positions t of -log p(x_{t+1} | x_{<=t}) / number of learned positions,
token-weighted over the whole set (not a mean of per-batch means); perplexity = exp(loss).
Labels follow the HF convention (`labels[t]` is the target of logits[t-1]; -100 is ignored).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from megalith.common.errors import DataError
from megalith_llama.corpus import builtin_documents
from megalith_llama.dataset import IGNORE_INDEX, model_inputs
from megalith_llama.encoding import make_encoder
from megalith_llama.packing import pack_tokens

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EvalResult:
    """Token-weighted mean loss (nats), its perplexity, and how much was evaluated."""

    loss: float
    perplexity: float
    tokens: int
    sequences: int


class SequenceList(Dataset[dict[str, torch.Tensor]]):
    """In-memory packed sequences with the same items as `PackedDataset` (input_ids, labels)."""

    def __init__(self, input_ids: np.ndarray, loss_mask: np.ndarray) -> None:
        self.input_ids = torch.from_numpy(input_ids.astype(np.int64))
        self.labels = self.input_ids.masked_fill(torch.from_numpy(loss_mask == 0), IGNORE_INDEX)

    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.input_ids[i], "labels": self.labels[i]}


def heldout_sequences(tokenizer: Any, seq_len: int, max_sequences: int | None = None) -> SequenceList:
    """The built-in corpus's held-out split, tokenized and packed into rows of `seq_len` (last row padded)."""
    encoder = make_encoder(tokenizer)
    docs = [("", d.text) for d in builtin_documents("heldout")]
    chunk = encoder.encode_documents(docs)
    starts = np.cumsum(chunk.lengths) - chunk.lengths
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else encoder.eos_id
    packed, _ = pack_tokens(chunk.ids, chunk.loss_mask, starts, seq_len, pad)
    rows = slice(None) if max_sequences is None else slice(0, max_sequences)
    return SequenceList(packed.input_ids[rows], packed.loss_mask[rows])


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    dataset: Dataset[dict[str, torch.Tensor]],
    batch_size: int = 8,
    max_batches: int | None = None,
    device: torch.device | str = "cpu",
    progress: Callable[[Iterable[Any]], Iterable[Any]] | None = None,
) -> EvalResult:
    """Validation loss / perplexity of `model` over `dataset` (PackedDataset or SequenceList items)."""
    model.eval()
    dtype = next(model.parameters()).dtype
    loader: Iterable[Any] = DataLoader(dataset, batch_size=batch_size, shuffle=False)
    if progress is not None:
        loader = progress(loader)
    total, count, seqs = 0.0, 0, 0
    for b, batch in enumerate(loader):
        if max_batches is not None and b >= max_batches:
            break
        inputs = {k: v.to(device) for k, v in model_inputs(batch, dtype).items()}
        labels = inputs["labels"]
        targets = labels[:, 1:]
        n = int((targets != IGNORE_INDEX).sum())
        # The model's own loss (mean over the shifted labelled tokens): under tensor parallelism the
        # logits are vocabulary or sequence shards and only the model's loss function sees them whole.
        total += float(model(**inputs).loss.float()) * n if n else 0.0
        count += n
        seqs += labels.shape[0]
    if count == 0:
        raise DataError("no labelled tokens to evaluate")
    loss = total / count
    return EvalResult(loss=loss, perplexity=math.exp(min(loss, 700.0)), tokens=count, sequences=seqs)
