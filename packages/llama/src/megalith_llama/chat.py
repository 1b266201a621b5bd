"""Streaming terminal chat: the tokenizer's chat template, `generate` in a thread, and
`TextIteratorStreamer` printing the reply as it is produced."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, TextIO

import torch

from megalith.common.errors import ConfigError

EXIT_WORDS = ("/exit", "/quit")


@dataclass(frozen=True)
class ChatConfig:
    """Generation settings; temperature 0 means greedy decoding."""

    max_new_tokens: int = 256
    temperature: float = 0.7
    top_p: float = 0.9
    system: str | None = None
    seed: int = 0
    timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if not self.max_new_tokens > 0:
            raise ConfigError(f"--max-new-tokens must be > 0, got {self.max_new_tokens}")
        if not self.temperature >= 0:  # NaN fails too
            raise ConfigError(f"--temperature must be >= 0 (0 is greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"--top-p must be in (0, 1], got {self.top_p}")


def stream_reply(
    model: Any, tokenizer: Any, messages: list[dict[str, str]], config: ChatConfig, out: TextIO
) -> str:
    """Generate the assistant's reply to `messages`, writing text to `out` as it streams; returns it."""
    from transformers import TextIteratorStreamer

    if tokenizer.chat_template is None:
        raise ConfigError("the tokenizer has no chat template")
    enc = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    device = next(model.parameters()).device
    streamer = TextIteratorStreamer(
        tokenizer, skip_prompt=True, skip_special_tokens=True, timeout=config.timeout_s
    )
    sampling = {"do_sample": True, "temperature": config.temperature, "top_p": config.top_p}
    kwargs = {
        "input_ids": enc["input_ids"].to(device),
        "attention_mask": enc["attention_mask"].to(device),
        "max_new_tokens": config.max_new_tokens,
        "streamer": streamer,
        "pad_token_id": tokenizer.pad_token_id
        if tokenizer.pad_token_id is not None
        else tokenizer.eos_token_id,
        **(sampling if config.temperature > 0 else {"do_sample": False}),
    }
    torch.manual_seed(config.seed)
    thread = threading.Thread(target=model.generate, kwargs=kwargs, daemon=True)
    thread.start()
    pieces = []
    for text in streamer:
        pieces.append(text)
        out.write(text)
        out.flush()
    thread.join(timeout=config.timeout_s)
    out.write("\n")
    return "".join(pieces)


def chat_loop(
    model: Any, tokenizer: Any, config: ChatConfig, inp: TextIO, out: TextIO
) -> list[dict[str, str]]:
    """Read user lines from `inp` until EOF or /exit, stream replies to `out`; returns the conversation."""
    messages: list[dict[str, str]] = [{"role": "system", "content": config.system}] if config.system else []
    while True:
        out.write("you> ")
        out.flush()
        line = inp.readline()
        if not line or line.strip() in EXIT_WORDS:
            return messages
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line.strip()})
        out.write("assistant> ")
        reply = stream_reply(model, tokenizer, messages, config, out)
        messages.append({"role": "assistant", "content": reply})
