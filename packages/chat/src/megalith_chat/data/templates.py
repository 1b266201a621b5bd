"""Chat messages and rendering them with the tokenizer's own chat template.

A conversation is a sequence of ``{"role": ..., "content": ...}`` mappings (the Hugging Face
form), roles ``system`` / ``user`` / ``assistant``. Rendering always goes through
``tokenizer.apply_chat_template`` so training sees exactly the format the model was tuned on;
:data:`CHATML_TEMPLATE` is only a fallback for tokenizers that ship without a template.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from megalith.common.errors import DataError

logger = logging.getLogger(__name__)

Message = Mapping[str, str]
ROLES = ("system", "user", "assistant")

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def validate_messages(messages: Any, where: str) -> tuple[dict[str, str], ...]:
    """Check a conversation's structure; :class:`DataError` naming ``where`` (e.g. ``file:line``)."""
    if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
        raise DataError(f"{where}: messages must be a non-empty list, got {type(messages).__name__}")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise DataError(f"{where}: message {i} must be an object, got {message!r}")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise DataError(f"{where}: message {i} has role {role!r}; expected one of {ROLES}")
        if not isinstance(content, str):
            raise DataError(f"{where}: message {i} content must be a string, got {content!r}")
        out.append({"role": str(role), "content": content})
    return tuple(out)


def ensure_chat_template(tokenizer: Any, fallback: str = CHATML_TEMPLATE) -> None:
    """Give ``tokenizer`` the ChatML template if it has none (logged, since it changes the format)."""
    if not getattr(tokenizer, "chat_template", None):
        logger.warning("tokenizer has no chat template; using ChatML")
        tokenizer.chat_template = fallback


def render_chat(tokenizer: Any, messages: Sequence[Message], add_generation_prompt: bool = False) -> str:
    """The conversation as text, formatted by ``tokenizer.apply_chat_template``."""
    text = tokenizer.apply_chat_template(
        [dict(m) for m in messages], tokenize=False, add_generation_prompt=add_generation_prompt
    )
    if not isinstance(text, str):
        raise DataError(f"chat template returned {type(text).__name__}, expected str")
    return text


def prompt_messages(prompt: str | Sequence[Message], system: str | None = None) -> tuple[dict[str, str], ...]:
    """A prompt given as plain text (one user turn) or as messages, with an optional system turn first."""
    messages = (
        ({"role": "user", "content": prompt},)
        if isinstance(prompt, str)
        else validate_messages(prompt, "prompt")
    )
    if system is not None and messages[0]["role"] != "system":
        messages = ({"role": "system", "content": system}, *messages)
    return tuple(dict(m) for m in messages)


def encode_prompt(tokenizer: Any, prompt: str | Sequence[Message], system: str | None = None) -> list[int]:
    """Token ids of the prompt rendered with the generation prompt (the assistant header) appended."""
    text = render_chat(tokenizer, prompt_messages(prompt, system), add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
