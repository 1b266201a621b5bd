"""Tokenising conversations for supervised fine-tuning with assistant-only labels.

``labels[i] = input_ids[i]`` on the tokens of assistant *content* plus the first token after
each assistant turn's content (the template's end-of-turn marker, e.g. ``<|im_end|>``, so the
model learns to stop), and ``-100`` everywhere else (system/user turns, role headers,
separators). Labels are *aligned* with ``input_ids`` (a causal LM shifts them itself).

How: the conversation is rendered once with the tokenizer's chat template and tokenised with
character offsets; each assistant message's content is located in the text after the rendered
prefix that precedes it, and tokens overlapping that character span are labelled. This works
for any template that embeds the message content verbatim (or trimmed).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from megalith.common.errors import ConfigError, DataError
from megalith_chat.data.templates import Message, render_chat

IGNORE_INDEX = -100  # the label value Hugging Face losses skip
MIN_MAX_LENGTH = 2  # a causal LM needs one context token before the first predicted one


@dataclass(frozen=True)
class TokenizedExample:
    """``input_ids`` and aligned ``labels`` (``-100`` = not trained on), equal lengths."""

    input_ids: tuple[int, ...]
    labels: tuple[int, ...]

    @property
    def num_trained_tokens(self) -> int:
        return sum(label != IGNORE_INDEX for label in self.labels)


def _content_span(full: str, prefix: str, content: str, cursor: int, where: str) -> tuple[int, int]:
    """Character span of ``content`` in ``full`` at or after the rendered ``prefix`` / ``cursor``."""
    if full.startswith(prefix):
        cursor = max(cursor, len(prefix))
    for candidate in (content, content.strip()):
        start = full.find(candidate, cursor)
        if start >= 0:
            return start, start + len(candidate)
    raise DataError(f"{where}: the chat template does not reproduce assistant content {content[:40]!r}")


def assistant_spans(
    tokenizer: Any, messages: Sequence[Message], which: Literal["all", "last"] = "all", where: str = "example"
) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the ``[start, end)`` character spans of assistant contents."""
    full = render_chat(tokenizer, messages)
    spans: list[tuple[int, int]] = []
    cursor = 0
    assistant_turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not assistant_turns:
        raise DataError(f"{where}: the conversation has no assistant message to train on")
    for i in assistant_turns if which == "all" else assistant_turns[-1:]:
        prefix = render_chat(tokenizer, messages[:i], add_generation_prompt=True) if i > 0 else ""
        span = _content_span(full, prefix, messages[i]["content"], cursor, where)
        spans.append(span)
        cursor = span[1]
    return full, spans


def _label_mask(offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]) -> list[bool]:
    """Tokens overlapping a span, plus the first token starting at/after each span's end."""
    mask = [False] * len(offsets)
    for start, end in spans:
        for i, (tok_start, tok_end) in enumerate(offsets):
            if tok_end > tok_start and tok_start < end and tok_end > start:
                mask[i] = True
        after = [
            i for i, (tok_start, tok_end) in enumerate(offsets) if tok_start >= end and tok_end > tok_start
        ]
        if after:
            mask[after[0]] = True
    return mask


def tokenize_conversation(
    tokenizer: Any,
    messages: Sequence[Message],
    max_length: int | None = None,
    train_on: Literal["all", "last"] = "all",
    where: str = "example",
) -> TokenizedExample:
    """Tokenise a conversation with labels only on assistant content + end-of-turn tokens.

    ``train_on="last"`` labels only the final assistant turn (preference data, where earlier
    assistant turns are context). ``max_length`` (>= ``MIN_MAX_LENGTH``, else :class:`ConfigError`)
    truncates from the right; it may leave no trained token (:func:`check_trained_tokens`).
    """
    check_max_length(max_length)
    full, spans = assistant_spans(tokenizer, messages, train_on, where)
    encoded = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(encoded["input_ids"])
    mask = _label_mask([tuple(o) for o in encoded["offset_mapping"]], spans)
    labels = [tok if keep else IGNORE_INDEX for tok, keep in zip(ids, mask)]
    if max_length is not None:
        ids, labels = ids[:max_length], labels[:max_length]
    return TokenizedExample(tuple(ids), tuple(labels))


def check_max_length(max_length: int | None, flag: str = "max_length") -> None:
    """:class:`ConfigError` naming ``max_length`` unless it is ``None`` or ``>= MIN_MAX_LENGTH``."""
    if max_length is not None and max_length < MIN_MAX_LENGTH:
        raise ConfigError(f"{flag} must be >= {MIN_MAX_LENGTH}, got {max_length}")


def check_trained_tokens(
    example: TokenizedExample, where: str, max_length: int | None, what: str = ""
) -> None:
    """:class:`DataError` naming ``where`` when truncation left ``example`` no trained token.

    Such an example would add nothing to the SFT loss (and a preference pair with an empty side
    compares two prompts: a constant DPO loss of log 2, a reward model scoring truncated text).
    """
    if example.num_trained_tokens == 0:
        side = f"the {what} response " if what else ""
        raise DataError(
            f"{where}: {side}has no trained token left after truncation to max_length={max_length} "
            f"(the tokens before the response already fill it); raise --max-length or shorten the prompt"
        )


@dataclass(frozen=True)
class TokenizedPair:
    """A preference pair: the same prompt with the chosen and with the rejected response."""

    chosen: TokenizedExample
    rejected: TokenizedExample


def tokenize_preference(
    tokenizer: Any,
    prompt: Sequence[Message],
    chosen: str,
    rejected: str,
    max_length: int | None = None,
    where: str = "example",
) -> TokenizedPair:
    """Tokenise ``prompt + chosen`` and ``prompt + rejected``, labelling only the final response."""

    def one(response: str) -> TokenizedExample:
        messages = [*prompt, {"role": "assistant", "content": response}]
        return tokenize_conversation(tokenizer, messages, max_length, "last", where)

    return TokenizedPair(one(chosen), one(rejected))
