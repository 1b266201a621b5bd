"""Human-readable previews of tokenised samples with the loss mask highlighted.

Trained tokens (label != -100) are shown in bold green with ANSI colours, or wrapped in
``[[`` ... ``]]`` without colour; everything else is dimmed (or plain).
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import groupby
from pathlib import Path
from typing import Any, Literal

from megalith.common.errors import ConfigError
from megalith_chat.data.datasets import (
    PreferenceExample,
    PromptExample,
    SFTExample,
    load_preference_dataset,
    load_prompt_dataset,
    load_sft_dataset,
)
from megalith_chat.data.sft import IGNORE_INDEX, TokenizedExample, tokenize_conversation, tokenize_preference
from megalith_chat.data.templates import render_chat

TRAINED_ON, CONTEXT_ON, RESET = "\x1b[1;32m", "\x1b[2m", "\x1b[0m"
OPEN_MARK, CLOSE_MARK = "[[", "]]"
DataKind = Literal["sft", "preference", "prompt"]
DATA_KINDS: tuple[str, ...] = ("sft", "preference", "prompt")


def render_loss_mask(tokenizer: Any, example: TokenizedExample, color: bool = True) -> str:
    """The decoded sample with trained spans highlighted, then a one-line token count."""
    pieces = []
    pairs = zip(example.input_ids, example.labels)
    for trained, run in groupby(pairs, key=lambda pair: pair[1] != IGNORE_INDEX):
        text = tokenizer.decode([tok for tok, _ in run], skip_special_tokens=False)
        if color:
            pieces.append(f"{TRAINED_ON if trained else CONTEXT_ON}{text}{RESET}")
        else:
            pieces.append(f"{OPEN_MARK}{text}{CLOSE_MARK}" if trained else text)
    total, trained_count = len(example.input_ids), example.num_trained_tokens
    share = 100.0 * trained_count / max(total, 1)
    return "".join(pieces) + f"\n-- {total} tokens, {trained_count} trained on ({share:.1f}%)"


def _legend(color: bool) -> str:
    if color:
        return f"legend: {TRAINED_ON}trained on{RESET} / {CONTEXT_ON}context (label -100){RESET}"
    return f"legend: {OPEN_MARK}trained on{CLOSE_MARK} / unmarked = context (label -100)"


def _preview_one(tokenizer: Any, example: Any, max_length: int | None, color: bool) -> str:
    if isinstance(example, SFTExample):
        tokenized = tokenize_conversation(tokenizer, example.messages, max_length, where=example.source)
        return render_loss_mask(tokenizer, tokenized, color)
    if isinstance(example, PreferenceExample):
        pair = tokenize_preference(
            tokenizer, example.prompt, example.chosen, example.rejected, max_length, example.source
        )
        chosen = render_loss_mask(tokenizer, pair.chosen, color)
        rejected = render_loss_mask(tokenizer, pair.rejected, color)
        return f"[chosen]\n{chosen}\n[rejected]\n{rejected}"
    if not isinstance(example, PromptExample):
        raise ConfigError(
            f"cannot preview {type(example).__name__}; expected an SFT, preference or prompt example"
        )
    text = render_chat(tokenizer, example.prompt, add_generation_prompt=True)
    extras = f"answer: {example.answer!r}" + (
        f"  metadata: {dict(example.metadata)}" if example.metadata else ""
    )
    return f"{text}\n-- prompt only (no loss tokens; the response is generated)  {extras}"


def preview_examples(
    tokenizer: Any, examples: Iterable[Any], max_length: int | None = None, color: bool = True
) -> str:
    """Preview several loaded examples (SFT, preference or prompt) one after another."""
    blocks = [_legend(color)]
    for example in examples:
        blocks.append(
            f"=== {example.source or 'sample'} ===\n{_preview_one(tokenizer, example, max_length, color)}"
        )
    return "\n\n".join(blocks)


def load_examples(path: str | Path, kind: DataKind) -> list[Any]:
    """Load a JSONL dataset of the given kind (``sft`` | ``preference`` | ``prompt``)."""
    if kind == "sft":
        return list(load_sft_dataset(path))
    if kind == "preference":
        return list(load_preference_dataset(path))
    if kind == "prompt":
        return list(load_prompt_dataset(path))
    raise ConfigError(f"unknown data kind {kind!r}; expected one of {DATA_KINDS}")
