"""Sampling ``G`` responses per prompt with Hugging Face ``generate`` and recording their log-probs.

Layout (as :class:`megalith_chat.messages.RolloutBatch` expects), ``B = num_prompts * G``:

* prompts are rendered with the tokenizer's chat template and **left**-padded to ``[B, P]``;
* responses are **right**-padded to ``[B, R]`` (``R <= max_new_tokens``); ``response_mask`` is 1
  on generated tokens up to and including the first end-of-sequence token;
* ``logprobs[b, t] = log softmax(logits_t / T)[y_t]`` -- the log-probability under the
  distribution that was actually sampled from (temperature ``T``, no top-k/top-p truncation),
  which is what PPO's "old" policy / truncated importance sampling need.

The same positions convention is used by :func:`response_logprobs` in the trainer, so a model at
the same weights reproduces the sampler's log-probs (up to float round-off).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from megalith.common.errors import ConfigError
from megalith_chat.algorithms.logprobs import IGNORE_INDEX, token_logprobs
from megalith_chat.data.templates import Message, render_chat


@dataclass(frozen=True)
class SamplingConfig:
    """How responses are sampled; ``temperature=0`` means greedy decoding."""

    max_new_tokens: int = 48
    temperature: float = 1.0

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not self.temperature >= 0:  # NaN fails too
            raise ConfigError(f"temperature must be >= 0, got {self.temperature}")


@dataclass(frozen=True)
class Generated:
    """Sampled responses of ``B`` rows (see module docstring for the layout)."""

    prompt_ids: torch.Tensor  # [B, P] long, left-padded
    prompt_mask: torch.Tensor  # [B, P]
    response_ids: torch.Tensor  # [B, R] long, right-padded
    response_mask: torch.Tensor  # [B, R]
    logprobs: torch.Tensor  # [B, R] float32, 0 off-mask
    truncated: torch.Tensor  # [B] bool: hit max_new_tokens without an end-of-sequence token
    texts: tuple[str, ...]  # decoded responses (special tokens removed)


def encode_prompts(
    tokenizer: Any, prompts: Sequence[Sequence[Message]], response_prefix: str = ""
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chat-template each prompt (with the assistant header, then ``response_prefix``) and left-pad.

    Returns ``[N, P]`` ids and mask. A ``response_prefix`` such as ``"<answer>"`` starts the
    assistant's reply for it (the model continues from there; rewards see prefix + completion).
    """
    rows = [
        tokenizer(
            render_chat(tokenizer, p, add_generation_prompt=True) + response_prefix, add_special_tokens=False
        )["input_ids"]
        for p in prompts
    ]
    if not rows or any(len(r) == 0 for r in rows):
        raise ConfigError("every prompt must render to at least one token")
    width = max(len(r) for r in rows)
    pad = pad_token_id(tokenizer)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :] = torch.tensor(row, dtype=torch.long)
        mask[i, width - len(row) :] = 1
    return ids, mask


def pad_token_id(tokenizer: Any) -> int:
    """The pad id, falling back to the end-of-sequence id."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise ConfigError("the tokenizer has neither a pad nor an end-of-sequence token")
    return int(pad)


def eos_token_ids(tokenizer: Any, model: Any) -> list[int]:
    """End-of-sequence ids: the tokenizer's EOS plus the model's generation config ones."""
    ids = {int(tokenizer.eos_token_id)} if tokenizer.eos_token_id is not None else set()
    extra = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(extra, int):
        ids.add(extra)
    elif isinstance(extra, list | tuple):
        ids.update(int(e) for e in extra)
    if not ids:
        raise ConfigError("no end-of-sequence token id known for this tokenizer/model")
    return sorted(ids)


def _response_mask(response_ids: torch.Tensor, eos_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """1 up to and including the first EOS; ``truncated`` rows have no EOS at all."""
    is_eos = torch.isin(response_ids, torch.tensor(list(eos_ids), device=response_ids.device))
    seen_before = (is_eos.long().cumsum(dim=1) - is_eos.long()) > 0
    return (~seen_before).long(), ~is_eos.any(dim=1)


@torch.no_grad()
def generate(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[Sequence[Message]],
    group_size: int,
    sampling: SamplingConfig,
    response_prefix: str = "",
) -> Generated:
    """``group_size`` responses for each prompt, the ``G`` samples of a prompt contiguous.

    ``texts`` are ``response_prefix`` + the decoded response, i.e. what the reward sees.
    """
    if group_size < 1:
        raise ConfigError(f"group_size must be >= 1, got {group_size}")
    ids, mask = encode_prompts(tokenizer, prompts, response_prefix)
    ids, mask = ids.repeat_interleave(group_size, 0), mask.repeat_interleave(group_size, 0)
    device = next(model.parameters()).device
    eos = eos_token_ids(tokenizer, model)
    greedy = sampling.temperature == 0
    kwargs: dict[str, Any] = (
        {"do_sample": False}
        if greedy
        else {
            "do_sample": True,
            "temperature": sampling.temperature,
            "top_k": 0,
            "top_p": 1.0,
        }
    )
    was_training = model.training
    model.eval()
    out = model.generate(
        input_ids=ids.to(device),
        attention_mask=mask.to(device),
        max_new_tokens=sampling.max_new_tokens,
        pad_token_id=pad_token_id(tokenizer),
        eos_token_id=eos,
        return_dict_in_generate=True,
        output_logits=True,
        **kwargs,
    )
    model.train(was_training)
    response = out.sequences[:, ids.shape[1] :].cpu()
    resp_mask, truncated = _response_mask(response, eos)
    logits = torch.stack(out.logits, dim=1).float().cpu()  # [B, R, V]
    if not greedy:
        logits = logits / sampling.temperature
    labels = torch.where(resp_mask.bool(), response, torch.full_like(response, IGNORE_INDEX))
    logprobs = token_logprobs(logits, labels)
    decoded = [
        tokenizer.decode(r[m.bool()].tolist(), skip_special_tokens=True) for r, m in zip(response, resp_mask)
    ]
    texts = tuple(response_prefix + t for t in decoded)
    return Generated(ids, mask, response, resp_mask, logprobs, truncated, texts)


def response_logprobs(
    model: Any,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Per-token log-probs ``[B, R]`` of the responses under ``model`` (with gradient if enabled).

    One forward pass over ``[prompt | response]`` with position ids from the attention mask
    (``cumsum - 1``, matching ``generate`` on left-padded prompts); the logits at position
    ``P + t - 1`` score response token ``t``; logits are divided by ``temperature`` (if > 0).
    """
    device = next(model.parameters()).device
    input_ids = torch.cat([prompt_ids, response_ids], dim=1).to(device)
    attn = torch.cat([prompt_mask, response_mask], dim=1).to(device)
    position_ids = (attn.long().cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=input_ids, attention_mask=attn, position_ids=position_ids).logits
    p = prompt_ids.shape[1]
    logits = logits[:, p - 1 : -1].float()
    if temperature > 0:
        logits = logits / temperature
    labels = torch.where(response_mask.bool().to(device), response_ids.to(device), IGNORE_INDEX)
    return token_logprobs(logits, labels)
