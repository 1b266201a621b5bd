"""SFT, DPO and reward-model (Bradley-Terry) training on the megalith Booster.

* **sft**: next-token cross-entropy on assistant tokens only (labels ``-100`` elsewhere,
  :func:`~megalith_chat.data.sft.tokenize_conversation`), mean over labelled tokens.
* **dpo**: :func:`~megalith_chat.algorithms.dpo_loss` on summed response log-probs; the reference
  log-probs come from the initial policy (with LoRA: the base model, adapters disabled),
  computed once per pair before training.
* **rm**: a sequence-classification head (``num_labels=1``) on the causal LM; the score of a
  sequence is the head's output at its last token; :func:`~megalith_chat.algorithms.bradley_terry_loss`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn
from torch.utils.data import Dataset

from megalith.common.errors import ConfigError
from megalith.common.utils import require
from megalith_chat.algorithms import IGNORE_INDEX, bradley_terry_loss, dpo_loss, token_logprobs
from megalith_chat.data.datasets import load_preference_dataset, load_sft_dataset
from megalith_chat.data.sft import (
    TokenizedExample,
    check_trained_tokens,
    tokenize_conversation,
    tokenize_preference,
)


class ListDataset(Dataset):
    def __init__(self, items: Sequence[Any]) -> None:
        self.items = list(items)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> Any:
        return self.items[i]


def pad_examples(examples: Sequence[TokenizedExample], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad to ``[batch, max_len]``: ``input_ids``, ``attention_mask``, ``labels`` (-100 on pads)."""
    width = max(len(e.input_ids) for e in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for i, e in enumerate(examples):
        n = len(e.input_ids)
        ids[i, :n] = torch.tensor(e.input_ids)
        labels[i, :n] = torch.tensor(e.labels)
        mask[i, :n] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def sequence_logps(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """``sum_t log pi(y_t | y_<t)`` over labelled tokens, ``[batch]`` (labels aligned, shifted here)."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return token_logprobs(logits[:, :-1], batch["labels"][:, 1:]).sum(-1)


# -- SFT ----------------------------------------------------------------------------------------
def sft_dataset(path: str, tokenizer: Any, max_length: int | None) -> ListDataset:
    """Tokenised examples; :class:`DataError` (``file:line``) for one that truncation leaves untrained."""
    examples = []
    for e in load_sft_dataset(path):
        example = tokenize_conversation(tokenizer, e.messages, max_length, where=e.source)
        check_trained_tokens(example, e.source, max_length)
        examples.append(example)
    return ListDataset(examples)


def sft_collate(pad_id: int) -> Any:
    return lambda items: pad_examples(items, pad_id)


def sft_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
    """Mean next-token cross-entropy over labelled tokens."""
    logp = token_logprobs(
        model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1],
        batch["labels"][:, 1:],
    )
    count = (batch["labels"][:, 1:] != IGNORE_INDEX).sum().clamp(min=1)
    return -logp.sum() / count, {"tokens": float(count)}


# -- preference pairs ---------------------------------------------------------------------------
@dataclass(frozen=True)
class EncodedPair:
    chosen: TokenizedExample
    rejected: TokenizedExample
    ref_chosen: float = 0.0
    ref_rejected: float = 0.0


def preference_dataset(path: str, tokenizer: Any, max_length: int | None) -> list[EncodedPair]:
    """Tokenised pairs; :class:`DataError` (``file:line``) for one with a side truncation left untrained."""
    pairs = []
    for e in load_preference_dataset(path):
        pair = tokenize_preference(tokenizer, e.prompt, e.chosen, e.rejected, max_length, e.source)
        check_trained_tokens(pair.chosen, e.source, max_length, "chosen")
        check_trained_tokens(pair.rejected, e.source, max_length, "rejected")
        pairs.append(EncodedPair(pair.chosen, pair.rejected))
    return pairs


def pair_collate(pad_id: int) -> Any:
    def collate(items: Sequence[EncodedPair]) -> dict[str, torch.Tensor]:
        both = pad_examples([i.chosen for i in items] + [i.rejected for i in items], pad_id)
        both["ref"] = torch.tensor([[i.ref_chosen, i.ref_rejected] for i in items], dtype=torch.float32)
        return both

    return collate


@torch.no_grad()
def with_reference_logps(
    model: nn.Module, pairs: list[EncodedPair], pad_id: int, batch_size: int = 8
) -> ListDataset:
    """Attach the (frozen) reference log-probs of each pair; ``model`` is the initial policy."""
    from dataclasses import replace

    collate = pair_collate(pad_id)
    out: list[EncodedPair] = []
    for start in range(0, len(pairs), batch_size):
        chunk = pairs[start : start + batch_size]
        logps = sequence_logps(model, collate(chunk))
        n = len(chunk)
        out.extend(
            replace(p, ref_chosen=float(logps[i]), ref_rejected=float(logps[n + i]))
            for i, p in enumerate(chunk)
        )
    return ListDataset(out)


def dpo_loss_fn(beta: float, loss_type: Literal["sigmoid", "ipo"] = "sigmoid") -> Any:
    def fn(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        logps = sequence_logps(model, batch)
        n = logps.shape[0] // 2
        out = dpo_loss(
            logps[:n], logps[n:], batch["ref"][:, 0], batch["ref"][:, 1], beta=beta, loss_type=loss_type
        )
        margin = float((out.chosen_rewards - out.rejected_rewards).mean())
        return out.loss, {"margin": margin, "reward_accuracy": out.reward_accuracy}

    return fn


# -- reward model ---------------------------------------------------------------------------------
def load_reward_model(path: str) -> nn.Module:
    """A causal LM's backbone with a fresh scalar head (``num_labels=1``)."""
    transformers = require("transformers", extra="hf")
    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        path, num_labels=1, dtype=torch.float32, local_files_only=True
    )
    if model.config.pad_token_id is None:
        raise ConfigError(
            f"the model at {path} has no pad_token_id; the reward head needs it to find the last token"
        )
    return model


def last_token_scores(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Scalar score per sequence at its last real token, ``[batch]``."""
    logits = model(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
    ).logits  # [B, 1] or [B, T, 1]
    if logits.dim() == 3:
        last = batch["attention_mask"].sum(-1) - 1
        logits = logits[torch.arange(logits.shape[0]), last]
    return logits.squeeze(-1)


def rm_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
    scores = last_token_scores(model, batch)
    n = scores.shape[0] // 2
    out = bradley_terry_loss(scores[:n], scores[n:])
    return out.loss, {
        "accuracy": out.reward_accuracy,
        "margin": float((scores[:n] - scores[n:]).detach().mean()),
    }
