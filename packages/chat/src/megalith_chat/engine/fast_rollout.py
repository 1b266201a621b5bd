"""The fast engine as a drop-in for :func:`megalith_chat.rollout.generation.generate` in producers.

:class:`FastGenerator` has ``generate``'s signature and returns the same
:class:`~megalith_chat.rollout.generation.Generated` layout (left-padded prompts, right-padded
responses, mask up to and including the first end-of-sequence token, log-probs
``log softmax(logits / T)[y]``), so a :class:`~megalith_chat.rollout.producer.RolloutWorker`
takes it as its ``generate_fn``. Stop strings are matched on the decoded text of each sequence,
incrementally at the engine's host syncs; a response that hits one ends with the token that
completed it, and its text is cut right after the stop string.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from megalith.common.errors import ConfigError
from megalith_chat.data.templates import Message
from megalith_chat.engine.fast import EngineOutput, FastEngine, FastEngineConfig
from megalith_chat.engine.sampling import SamplingParams
from megalith_chat.rollout.generation import (
    Generated,
    SamplingConfig,
    encode_prompts,
    eos_token_ids,
    pad_token_id,
)

logger = logging.getLogger(__name__)

ROLLOUT_ENGINES = ("auto", "hf", "fast")


class StopStrings:
    """Per-sequence incremental stop-string search; ``ends[r]`` = tokens kept for row ``r`` (or None)."""

    def __init__(self, tokenizer: Any, stops: Sequence[str], batch: int) -> None:
        self.tokenizer, self.stops = tokenizer, tuple(stops)
        self.ends: list[int | None] = [None] * batch
        self._checked = [0] * batch
        self._longest = max((len(s) for s in self.stops), default=0)

    def _text(self, row: list[int]) -> str:
        return str(self.tokenizer.decode(row, skip_special_tokens=True))

    def _hit(self, text: str, since: int) -> bool:
        """Whether ``text`` holds a stop string that ends at character ``since`` or later."""
        tail = text[max(0, since - self._longest + 1) :]
        return any(s in tail for s in self.stops)

    def __call__(self, tokens: torch.Tensor) -> list[int]:
        """``tokens [B, n]`` so far; returns the rows that newly hit a stop string."""
        finished = []
        for r in range(tokens.shape[0]):
            if self.ends[r] is not None:
                continue
            row, seen = tokens[r].tolist(), self._checked[r]
            # a sync may split a multi-byte character: its bytes decode to U+FFFD until complete, so
            # count only the characters before them as checked (the completed one is new text)
            before = len(self._text(row[:seen]).rstrip("\ufffd"))
            if self._hit(self._text(row), before):
                # the first token count whose text contains a stop string
                end = next(t for t in range(seen + 1, len(row) + 1) if self._hit(self._text(row[:t]), 0))
                self.ends[r] = end
                finished.append(r)
            self._checked[r] = len(row)
        return finished

    def cut(self, text: str) -> str:
        """``text`` up to and including its first stop string (unchanged if none)."""
        hits = [(text.find(s), s) for s in self.stops if s in text]
        if not hits:
            return text
        index, stop = min(hits)
        return text[: index + len(stop)]


class FastGenerator:
    """``generate(model, tokenizer, prompts, group_size, sampling, response_prefix)`` on a FastEngine.

    The ``model`` argument is ignored (the engine holds its own weights: call
    ``engine.update_weights(model)`` after every weight sync). The cache grows on demand.
    """

    def __init__(self, engine: FastEngine, stop: Sequence[str] = (), seed: int = 0) -> None:
        self.engine, self.stop = engine, tuple(stop)
        self.generator = torch.Generator(device=engine.device).manual_seed(seed)

    def __call__(
        self,
        model: Any,
        tokenizer: Any,
        prompts: Sequence[Sequence[Message]],
        group_size: int,
        sampling: SamplingConfig,
        response_prefix: str = "",
    ) -> Generated:
        if group_size < 1:
            raise ConfigError(f"group_size must be >= 1, got {group_size}")
        ids, mask = encode_prompts(tokenizer, prompts, response_prefix)
        ids, mask = ids.repeat_interleave(group_size, 0), mask.repeat_interleave(group_size, 0)
        greedy = sampling.temperature == 0
        params = SamplingParams(
            sampling.max_new_tokens,
            sampling.temperature if not greedy else 1.0,
            greedy=greedy,
            stop=self.stop,
        )
        self.engine.reserve(ids.shape[0], ids.shape[1] + params.max_new_tokens)
        eos, pad = eos_token_ids(tokenizer, model), pad_token_id(tokenizer)
        stops = StopStrings(tokenizer, self.stop, ids.shape[0]) if self.stop else None
        out = self.engine.generate(ids, mask, params, eos, pad, self.generator, stops, group=group_size)
        return _assemble((ids, mask), out, eos, pad, tokenizer, stops, response_prefix)


def _assemble(
    prompt: tuple[torch.Tensor, torch.Tensor],
    out: EngineOutput,
    eos: Sequence[int],
    pad: int,
    tokenizer: Any,
    stops: StopStrings | None,
    prefix: str,
) -> Generated:
    """Cut each row after its first EOS or stop string; build the ``Generated`` record."""
    (ids, mask), tokens, logprobs = prompt, out.tokens, out.logprobs
    steps = tokens.shape[1]
    is_eos = torch.isin(tokens, torch.tensor(list(eos), dtype=torch.long))
    first_eos = torch.where(is_eos.any(dim=1), is_eos.long().argmax(dim=1) + 1, steps + 1)
    stop_end = torch.tensor(
        [e if e is not None else steps + 1 for e in (stops.ends if stops else [None] * len(tokens))]
    )
    ends = torch.minimum(first_eos, stop_end).clamp(max=steps)
    keep = torch.arange(steps).unsqueeze(0) < ends.unsqueeze(1)
    response = torch.where(keep, tokens, pad)
    finished = (first_eos <= steps) | (stop_end <= steps)
    texts = []
    for r in range(len(tokens)):
        text = tokenizer.decode(response[r, : int(ends[r])].tolist(), skip_special_tokens=True)
        texts.append(prefix + (stops.cut(text) if stops is not None and stop_end[r] <= steps else text))
    return Generated(ids, mask, response, keep.long(), logprobs * keep, ~finished, tuple(texts))


def make_fast_generator(
    model: Any, name: str, dtype: str | None = None, seed: int = 0, share_prompts: bool | None = None
) -> FastGenerator | None:
    """``--rollout-engine``: ``"hf"`` -> None (HF generate), ``"fast"`` -> a FastGenerator,
    ``"auto"`` -> fast when CUDA is available, else HF. ``share_prompts``: ``--[no-]share-prompts``
    (None: the engine's default)."""
    if name not in ROLLOUT_ENGINES:
        raise ConfigError(f"rollout engine must be one of {ROLLOUT_ENGINES}, got {name!r}")
    if name == "hf" or (name == "auto" and not torch.cuda.is_available()):
        if share_prompts:
            logger.warning("--share-prompts applies to the fast rollout engine only; HF generate is used")
        return None
    config = FastEngineConfig(max_batch=16, max_len=256, dtype=dtype, share_prompts=share_prompts)
    engine = FastEngine(model, config)
    logger.info("fast rollout engine on %s (%s)", engine.device, engine.dtype)
    return FastGenerator(engine, seed=seed)
