"""Supervised fine-tuning data: multi-turn chats rendered with the tokenizer's chat template.

Input: jsonl lines `{"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}`
with at least one assistant message.

Loss mask. For assistant message i, the template is rendered for `messages[:i]` with the
generation prompt (`prefix`) and for `messages[:i+1]` (`upto`); the assistant span is the
characters from `len(prefix)` to the end of the first end token (default: the tokenizer's eos,
e.g. `<|im_end|>`) after the content. The whole conversation is tokenized once with offsets, and a
token is learned iff its characters lie inside an assistant span: assistant content and its end
token get labels, everything else (system/user turns, role headers, the newline after the end
token) gets -100. The template must render prefixes consistently (`upto` starts with `prefix`, and
the full text starts with `upto`), which ChatML-style templates do; otherwise `DataError`.

NEFTune (Jain et al. 2023, "NEFTune: Noisy Embeddings Improve Instruction Finetuning"): during
training, add `U(-1, 1) * alpha / sqrt(L * d)` to the input embeddings [B, L, d].
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megalith.common.errors import ConfigError, DataError
from megalith_llama.formats import ReadStats

logger = logging.getLogger(__name__)

IGNORE_INDEX = -100
ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class SFTExample:
    """One tokenized conversation: `input_ids` and `labels` (-100 outside assistant spans)."""

    input_ids: tuple[int, ...]
    labels: tuple[int, ...]


def validate_messages(obj: Any) -> list[dict[str, str]]:
    """The `messages` list of a jsonl record; raises ValueError with the reason when malformed."""
    if not isinstance(obj, dict) or not isinstance(obj.get("messages"), list):
        raise ValueError("expected an object with a 'messages' list")
    messages = obj["messages"]
    for k, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise ValueError(f"message {k} must be {{'role': one of {ROLES}, 'content': str}}, got {m!r}")
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError("the conversation has no assistant message")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def _render(tokenizer: Any, messages: list[dict[str, str]], generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def assistant_spans(
    tokenizer: Any, messages: list[dict[str, str]], end_text: str
) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the [start, end) character span of each assistant turn."""
    full = _render(tokenizer, messages, False)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prefix = _render(tokenizer, messages[:i], True) if i else ""
        upto = _render(tokenizer, messages[: i + 1], False)
        if not (upto.startswith(prefix) and full.startswith(upto)):
            raise ValueError(
                f"the chat template does not render message {i} as an extension of the ones before"
            )
        content_at = upto.find(message["content"], len(prefix))
        search_from = content_at + len(message["content"]) if content_at >= 0 else len(prefix)
        end_at = upto.find(end_text, search_from) if end_text else -1
        spans.append((len(prefix), len(upto) if end_at < 0 else end_at + len(end_text)))
    return full, spans


def tokenize_conversation(
    tokenizer: Any,
    messages: list[dict[str, str]],
    max_length: int | None = None,
    end_token: str | None = None,
) -> SFTExample:
    """Token ids and labels of a conversation (see the module docstring for the mask rule)."""
    if not getattr(tokenizer, "is_fast", False):
        raise ConfigError("SFT tokenization needs a fast tokenizer (it uses character offsets)")
    if tokenizer.chat_template is None:
        raise ConfigError("the tokenizer has no chat template")
    end_text = end_token if end_token is not None else (tokenizer.eos_token or "")
    full, spans = assistant_spans(tokenizer, messages, end_text)
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids, labels = list(enc["input_ids"]), []
    for tok, (lo, hi) in zip(ids, enc["offset_mapping"]):
        inside = hi > lo and any(a <= lo and hi <= b for a, b in spans)
        labels.append(tok if inside else IGNORE_INDEX)
    if max_length is not None:
        ids, labels = ids[:max_length], labels[:max_length]
    return SFTExample(tuple(ids), tuple(labels))


def load_sft_jsonl(
    path: str | Path,
    tokenizer: Any,
    max_length: int | None = None,
    skip_bad_lines: bool = False,
    stats: ReadStats | None = None,
) -> list[SFTExample]:
    """Tokenized conversations of a jsonl file; malformed lines raise `DataError` naming file:line.

    Conversations whose assistant tokens all fall beyond `max_length` are dropped (counted as empty).
    """
    file, stats = Path(path), stats if stats is not None else ReadStats()
    if not file.is_file():
        raise DataError(f"SFT file not found: {file}")
    examples = []
    with file.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                messages = validate_messages(json.loads(raw.decode("utf-8")))
                example = tokenize_conversation(tokenizer, messages, max_length)
            except ValueError as exc:
                stats.bad(f"{file}:{lineno}", str(exc), skip_bad_lines)
                continue
            if all(x == IGNORE_INDEX for x in example.labels):
                stats.empty += 1
                continue
            examples.append(example)
    if not examples:
        raise DataError(f"no usable conversations in {file}")
    return examples


def collate_sft(examples: list[SFTExample], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad to the longest example: input_ids/labels/attention_mask [B, L_max]."""
    width = max(len(e.input_ids) for e in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long)
    attn = torch.zeros((len(examples), width), dtype=torch.long)
    for row, e in enumerate(examples):
        n = len(e.input_ids)
        ids[row, :n] = torch.tensor(e.input_ids)
        labels[row, :n] = torch.tensor(e.labels)
        attn[row, :n] = 1
    return {"input_ids": ids, "labels": labels, "attention_mask": attn}


def neftune_noise(
    embeddings: torch.Tensor, alpha: float, generator: torch.Generator | None = None
) -> torch.Tensor:
    """`embeddings` [B, L, d] plus uniform noise of magnitude at most `alpha / sqrt(L * d)`."""
    if alpha < 0:
        raise ConfigError(f"NEFTune alpha must be >= 0, got {alpha}")
    scale = alpha / math.sqrt(embeddings.shape[-2] * embeddings.shape[-1])
    noise = torch.rand(
        embeddings.shape, generator=generator, dtype=embeddings.dtype, device=embeddings.device
    )
    return embeddings + (noise * 2 - 1) * scale


def enable_neftune(model: torch.nn.Module, alpha: float) -> torch.utils.hooks.RemovableHandle:
    """Register a forward hook on the input embedding that adds NEFTune noise in training mode only.

    Returns the hook handle; call `.remove()` to switch NEFTune off.
    """
    if alpha < 0:
        raise ConfigError(f"NEFTune alpha must be >= 0, got {alpha}")
    embedding = model.get_input_embeddings()  # type: ignore[operator]

    def hook(module: torch.nn.Module, _inputs: Any, output: torch.Tensor) -> torch.Tensor:
        return neftune_noise(output, alpha) if module.training else output

    return embedding.register_forward_hook(hook)


class SFTDataset(torch.utils.data.Dataset):
    """Tokenized `{"messages": [...]}` conversations, right-padded to `seq_len` (loss on assistant
    tokens and their end token only; see `sft_data.tokenize_conversation`)."""

    def __init__(self, path: str, tokenizer: Any, seq_len: int) -> None:
        examples = load_sft_jsonl(path, tokenizer, max_length=seq_len)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        batch = collate_sft(examples, pad)
        width = batch["input_ids"].shape[1]
        fill = {"input_ids": pad, "labels": -100, "attention_mask": 0}
        self.tensors = {
            k: torch.nn.functional.pad(v, (0, seq_len - width), value=fill[k]) for k, v in batch.items()
        }

    def __len__(self) -> int:
        return int(self.tensors["input_ids"].shape[0])

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {k: v[i] for k, v in self.tensors.items()}
