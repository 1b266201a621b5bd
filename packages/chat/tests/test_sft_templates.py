"""Chat templates and assistant-only label masks (golden tests on a tokenizer built in the test)."""

from __future__ import annotations

from typing import Any

import pytest

from megalith.common.errors import ConfigError, DataError
from megalith_chat.data import (
    CHATML_TEMPLATE,
    IGNORE_INDEX,
    encode_prompt,
    ensure_chat_template,
    render_chat,
    tokenize_conversation,
    tokenize_preference,
    validate_messages,
)

CONVERSATION = [
    {"role": "system", "content": "you are a helpful assistant"},
    {"role": "user", "content": "hello there"},
    # the assistant repeats the user's words: the mask must pick the assistant's copy
    {"role": "assistant", "content": "hello there"},
    {"role": "user", "content": "what is two plus two"},
    {"role": "assistant", "content": "four"},
]


def _trained_positions(example: Any) -> list[int]:
    return [i for i, label in enumerate(example.labels) if label != IGNORE_INDEX]


def test_render_uses_the_tokenizers_template(chat_tokenizer: Any) -> None:
    text = render_chat(chat_tokenizer, CONVERSATION[:2], add_generation_prompt=True)
    assert text == "<|system|>you are a helpful assistant<|end|>\n<|user|>hello there<|end|>\n<|assistant|>"


def test_golden_label_mask_covers_assistant_content_plus_end_token(chat_tokenizer: Any) -> None:
    example = tokenize_conversation(chat_tokenizer, CONVERSATION)
    tokens = chat_tokenizer.convert_ids_to_tokens(list(example.input_ids))
    # written out by hand from the template
    assert tokens == [
        "<|system|>", "you", "are", "a", "helpful", "assistant", "<|end|>",  # 0-6
        "<|user|>", "hello", "there", "<|end|>",  # 7-10
        "<|assistant|>", "hello", "there", "<|end|>",  # 11-14
        "<|user|>", "what", "is", "two", "plus", "two", "<|end|>",  # 15-21
        "<|assistant|>", "four", "<|end|>",  # 22-24
    ]  # fmt: skip
    assert _trained_positions(example) == [12, 13, 14, 23, 24]
    for i in _trained_positions(example):
        assert example.labels[i] == example.input_ids[i]
    assert example.num_trained_tokens == 5


def test_train_on_last_turn_only(chat_tokenizer: Any) -> None:
    example = tokenize_conversation(chat_tokenizer, CONVERSATION, train_on="last")
    assert _trained_positions(example) == [23, 24]


def test_truncation_keeps_alignment(chat_tokenizer: Any) -> None:
    example = tokenize_conversation(chat_tokenizer, CONVERSATION, max_length=14)
    assert len(example.input_ids) == len(example.labels) == 14
    assert _trained_positions(example) == [12, 13]


@pytest.mark.parametrize("max_length", [0, 1, -3])
def test_max_length_below_minimum_is_rejected(chat_tokenizer: Any, max_length: int) -> None:
    """0 crashed in the model and -3 silently cut 3 tokens off every example (``ids[:-3]``)."""
    with pytest.raises(ConfigError, match=f"max_length must be >= 2, got {max_length}"):
        tokenize_conversation(chat_tokenizer, CONVERSATION, max_length=max_length)


def test_chatml_fallback_template_golden(make_chat_tokenizer: Any) -> None:
    tok = make_chat_tokenizer(template=None, specials=("<|im_start|>", "<|im_end|>"))
    ensure_chat_template(tok)
    assert tok.chat_template == CHATML_TEMPLATE
    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "four four"}]
    example = tokenize_conversation(tok, messages)
    tokens = tok.convert_ids_to_tokens(list(example.input_ids))
    assert tokens == [
        "<|im_start|>", "<unk>", "hello", "<|im_end|>",
        "<|im_start|>", "assistant", "four", "four", "<|im_end|>",
    ]  # fmt: skip
    assert _trained_positions(example) == [6, 7, 8]


def test_preference_pair_labels_only_the_response(chat_tokenizer: Any) -> None:
    prompt = [{"role": "user", "content": "what is two plus two"}]
    pair = tokenize_preference(chat_tokenizer, prompt, chosen="four", rejected="two two")
    # prompt: <|user|> what is two plus two <|end|> <|assistant|> = 8 tokens
    assert _trained_positions(pair.chosen) == [8, 9]
    assert _trained_positions(pair.rejected) == [8, 9, 10]
    assert pair.chosen.input_ids[:8] == pair.rejected.input_ids[:8]


def test_encode_prompt_ends_with_generation_header(chat_tokenizer: Any) -> None:
    ids = encode_prompt(chat_tokenizer, "hello there", system="you are a helpful assistant")
    tokens = chat_tokenizer.convert_ids_to_tokens(ids)
    assert tokens[0] == "<|system|>" and tokens[-1] == "<|assistant|>"
    assert tokens[-5:-1] == ["<|user|>", "hello", "there", "<|end|>"]


def test_template_that_drops_content_is_reported(make_chat_tokenizer: Any) -> None:
    tok = make_chat_tokenizer(template="{% for m in messages %}<|{{ m['role'] }}|>x<|end|>{% endfor %}")
    with pytest.raises(DataError, match="does not reproduce assistant content 'four'"):
        tokenize_conversation(
            tok, [{"role": "user", "content": "a"}, {"role": "assistant", "content": "four"}]
        )


def test_conversation_without_assistant_rejected(chat_tokenizer: Any) -> None:
    with pytest.raises(DataError, match="no assistant"):
        tokenize_conversation(chat_tokenizer, [{"role": "user", "content": "hello"}], where="f.jsonl:3")


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ([], "non-empty list"),
        ("hello", "non-empty list"),
        ([{"role": "robot", "content": "x"}], "'robot'"),
        ([{"role": "user", "content": 3}], "content must be a string"),
        (["hi"], "must be an object"),
    ],
)
def test_validate_messages(messages: Any, match: str) -> None:
    with pytest.raises(DataError, match=match):
        validate_messages(messages, "data.jsonl:7")
    with pytest.raises(DataError, match="data.jsonl:7"):
        validate_messages(messages, "data.jsonl:7")


@pytest.mark.slow
def test_label_mask_on_smollm2_byte_level_bpe() -> None:
    """The shipped SmolLM2 tokenizer (byte-level BPE, ChatML with a default system turn)."""
    from megalith_chat.data.tokenizer import load_tokenizer

    tok = load_tokenizer("smollm2")
    messages = [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "<answer>4</answer>"},
        {"role": "user", "content": "And 3 + 3?"},
        {"role": "assistant", "content": " It is 6."},
    ]
    example = tokenize_conversation(tok, messages)
    trained = [example.input_ids[i] for i in _trained_positions(example)]
    assert tok.decode(trained) == "<answer>4</answer><|im_end|> It is 6.<|im_end|>"
    # nothing of the headers, the default system prompt or the user turns is trained on
    first = _trained_positions(example)[0]
    assert tok.decode(list(example.input_ids[:first])).endswith("<|im_start|>assistant\n")
