"""JSONL datasets for SFT, preference optimisation and RL prompts (formats in the package README).

Every loader reads one JSON object per line (blank lines are skipped) and raises
:class:`DataError` naming ``file:line`` for the first malformed record.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megalith.common.errors import DataError
from megalith_chat.data.templates import prompt_messages, validate_messages


@dataclass(frozen=True)
class SFTExample:
    """A conversation to fine-tune on; ``source`` is ``file:line``."""

    messages: tuple[dict[str, str], ...]
    source: str = ""


@dataclass(frozen=True)
class PreferenceExample:
    """A prompt (messages) with a preferred and a dispreferred assistant response."""

    prompt: tuple[dict[str, str], ...]
    chosen: str
    rejected: str
    source: str = ""


@dataclass(frozen=True)
class PromptExample:
    """An RL prompt with its reference ``answer`` (if any) and extra fields for reward functions."""

    prompt: tuple[dict[str, str], ...]
    answer: str | None = None
    metadata: Mapping[str, Any] = field(default_factory=dict)
    source: str = ""

    def reward_sample(self) -> dict[str, Any]:
        """The record reward functions receive: ``prompt`` (last user text), ``messages``, ``answer``, extras."""
        user_turns = [m["content"] for m in self.prompt if m["role"] == "user"]
        sample = {
            **self.metadata,
            "prompt": user_turns[-1] if user_turns else "",
            "messages": list(self.prompt),
        }
        if self.answer is not None:
            sample["answer"] = self.answer
        return sample

    def to_record(self) -> dict[str, Any]:
        """The JSONL form (plain-text prompt when it is a single user turn)."""
        single = len(self.prompt) == 1 and self.prompt[0]["role"] == "user"
        record: dict[str, Any] = {"prompt": self.prompt[0]["content"] if single else list(self.prompt)}
        if self.answer is not None:
            record["answer"] = self.answer
        return {**record, **self.metadata}


def read_jsonl(path: str | Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """Yield ``("file:line", object)`` for each non-blank line."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    with open(path, "rb") as f:  # decoded line by line, so a bad byte is reported at its own line
        for lineno, raw in enumerate(f, start=1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DataError(
                    f"{where}: not valid UTF-8 (byte 0x{raw[exc.start]:02x} at byte {exc.start + 1} of the "
                    "line); re-encode the file as UTF-8"
                ) from exc
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{where}: invalid JSON ({exc.msg} at column {exc.colno})") from exc
            if not isinstance(obj, dict):
                raise DataError(f"{where}: expected a JSON object, got {type(obj).__name__}")
            yield where, obj


def _text_field(obj: Mapping[str, Any], key: str, where: str) -> str:
    value = obj.get(key)
    if not isinstance(value, str):
        raise DataError(f"{where}: field {key!r} must be a string, got {value!r}")
    return value


def _prompt_field(obj: Mapping[str, Any], where: str) -> tuple[dict[str, str], ...]:
    prompt, system = obj.get("prompt"), obj.get("system")
    if system is not None and not isinstance(system, str):
        raise DataError(f"{where}: 'system' must be a string, got {system!r}")
    if isinstance(prompt, str) and prompt.strip():
        return prompt_messages(prompt, system)
    if isinstance(prompt, list):
        return prompt_messages(validate_messages(prompt, where), system)
    raise DataError(f"{where}: 'prompt' must be a non-empty string or a list of messages, got {prompt!r}")


def parse_sft_record(obj: Mapping[str, Any], where: str) -> SFTExample:
    """``{"messages": [...]}`` or ``{"prompt": str, "response": str}`` (optional ``"system"``)."""
    if "messages" in obj:
        messages = validate_messages(obj["messages"], where)
    elif "prompt" in obj and "response" in obj:
        response = {"role": "assistant", "content": _text_field(obj, "response", where)}
        messages = (*_prompt_field(obj, where), response)
    else:
        raise DataError(
            f"{where}: SFT record needs 'messages' or 'prompt'+'response', got keys {sorted(obj)}"
        )
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"{where}: conversation has no assistant message to train on")
    return SFTExample(messages, where)


def _split_conversation(messages: Any, where: str, key: str) -> tuple[tuple[dict[str, str], ...], str]:
    convo = validate_messages(messages, f"{where} ({key})")
    if convo[-1]["role"] != "assistant" or len(convo) < 2:
        raise DataError(f"{where}: {key!r} must end with an assistant message after a prompt")
    return convo[:-1], convo[-1]["content"]


def parse_preference_record(obj: Mapping[str, Any], where: str) -> PreferenceExample:
    """``{"prompt", "chosen": str, "rejected": str}`` or ``{"chosen": [msgs], "rejected": [msgs]}``."""
    chosen, rejected = obj.get("chosen"), obj.get("rejected")
    if isinstance(chosen, str) and isinstance(rejected, str):
        return PreferenceExample(_prompt_field(obj, where), chosen, rejected, where)
    if isinstance(chosen, list) and isinstance(rejected, list):
        prompt_c, text_c = _split_conversation(chosen, where, "chosen")
        prompt_r, text_r = _split_conversation(rejected, where, "rejected")
        if prompt_c != prompt_r:
            raise DataError(f"{where}: 'chosen' and 'rejected' must share the same prompt messages")
        return PreferenceExample(prompt_c, text_c, text_r, where)
    raise DataError(
        f"{where}: 'chosen' and 'rejected' must both be strings or both be message lists, "
        f"got {type(chosen).__name__} and {type(rejected).__name__}"
    )


def parse_prompt_record(obj: Mapping[str, Any], where: str) -> PromptExample:
    """``{"prompt": str | [msgs], "answer": str | number (optional), ...extra fields kept as metadata}``."""
    answer = obj.get("answer")
    if answer is not None and (isinstance(answer, bool) or not isinstance(answer, str | int | float)):
        raise DataError(f"{where}: 'answer' must be a string or a number, got {answer!r}")
    metadata = {k: v for k, v in obj.items() if k not in ("prompt", "answer", "system")}
    return PromptExample(_prompt_field(obj, where), None if answer is None else str(answer), metadata, where)


def load_sft_dataset(path: str | Path) -> list[SFTExample]:
    return [parse_sft_record(obj, where) for where, obj in read_jsonl(path)]


def load_preference_dataset(path: str | Path) -> list[PreferenceExample]:
    return [parse_preference_record(obj, where) for where, obj in read_jsonl(path)]


def load_prompt_dataset(path: str | Path) -> list[PromptExample]:
    return [parse_prompt_record(obj, where) for where, obj in read_jsonl(path)]
