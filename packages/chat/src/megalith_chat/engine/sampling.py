"""Batched token sampling for the fast rollout engine: greedy, temperature, top-k, top-p.

Every function is plain torch on ``[B, V]`` logits with the sampling parameters held as
tensors (``[B, 1]``), so one CUDA graph serves every parameter value.

**Log-prob convention** (the one :mod:`megalith_chat.rollout.generation` and the GRPO trainer's
``response_logprobs(..., temperature=T)`` use): the recorded log-prob of token ``y`` is

    ``log softmax(logits / T)[y]``  (``T = 1`` for greedy rows),

i.e. under the temperature-scaled policy **before** top-k / top-p truncation. With the default
``top_k=0, top_p=1`` this is exactly the distribution sampled from; with truncation the sampler
draws from the renormalised nucleus but the log-prob stays that of the untruncated
temperature-``T`` policy, which is what the trainer recomputes (PPO's "old" log-probs).

Sampling uses the exponential race (equivalent to a categorical draw): with ``E_i ~ Exp(1)``
i.i.d., ``argmax_i p_i / E_i`` is distributed as ``Categorical(p)``. The noise ``E`` is drawn by
the caller (outside a CUDA graph, from its own ``torch.Generator``), so runs are reproducible.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megalith.common.errors import ConfigError


@dataclass(frozen=True)
class SamplingParams:
    """How the fast engine decodes.

    ``greedy=True`` takes the arg-max (``temperature`` is then ignored and log-probs are those of
    the temperature-1 policy). Otherwise ``temperature > 0`` scales the logits, ``top_k > 0`` keeps
    the ``k`` most likely tokens and ``top_p`` in ``(0, 1]`` keeps the smallest set of most likely
    tokens whose probability mass reaches ``top_p`` (the nucleus; Holtzman et al. 2020).
    ``stop``: a tuple (a list is converted) of strings that end a sequence once its decoded text
    contains one. The engine holds no tokenizer, so the caller matches them in
    :meth:`FastEngine.generate`'s ``on_sync`` hook (``fast_rollout.StopStrings``, which
    ``FastGenerator`` passes); ``generate`` refuses a non-empty ``stop`` without a hook.
    """

    max_new_tokens: int = 48
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    greedy: bool = False
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not self.greedy and not self.temperature > 0:
            raise ConfigError(
                f"temperature must be > 0 when sampling (use greedy=True), got {self.temperature}"
            )
        if not self.greedy and not torch.isfinite(torch.tensor(1.0 / self.temperature, dtype=torch.float32)):
            raise ConfigError(
                f"temperature {self.temperature} is too small: 1 / temperature overflows float32 (use greedy=True)"
            )
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ConfigError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not isinstance(self.stop, (tuple, list)) or not all(isinstance(s, str) for s in self.stop):
            raise ConfigError(f"stop must be a tuple of strings, got {self.stop!r}")
        object.__setattr__(self, "stop", tuple(self.stop))
        if any(not s for s in self.stop):
            raise ConfigError(f"stop strings must be non-empty, got {self.stop!r}")

    @property
    def filtered(self) -> bool:
        """Whether top-k / top-p truncation is active (needs a sort over the vocabulary)."""
        return not self.greedy and (self.top_k > 0 or self.top_p < 1)

    @property
    def logprob_temperature(self) -> float:
        """The ``T`` of the recorded log-probs: the sampling temperature, or 1 for greedy."""
        return 1.0 if self.greedy else self.temperature


def nucleus_mask(probs: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """``[B, V]`` bool: tokens kept by top-k (``k <= 0`` = off) and top-p (``p = 1`` = off).

    In descending-probability order token ``r`` is kept when the mass strictly before it is
    ``< top_p`` (so the most likely token is always kept) and ``r < top_k``.
    """
    sorted_p, order = probs.sort(dim=-1, descending=True)
    before = sorted_p.cumsum(dim=-1) - sorted_p
    rank = torch.arange(probs.shape[-1], device=probs.device).unsqueeze(0)
    keep = (before < top_p) & ((top_k <= 0) | (rank < top_k))
    return torch.zeros_like(keep).scatter(-1, order, keep)


def sample_tokens(
    logits: torch.Tensor,
    inv_temperature: torch.Tensor,
    greedy: torch.Tensor,
    noise: torch.Tensor,
    top_p: torch.Tensor | None = None,
    top_k: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row; returns ``(tokens [B] long, logprobs [B] float32)``.

    ``logits [B, V]``, ``inv_temperature [B, 1]`` (1 on greedy rows), ``greedy [B]`` bool,
    ``noise [B, V]`` i.i.d. Exp(1); ``top_p``/``top_k`` ``[B, 1]`` enable truncation when given.
    Log-probs follow the module's convention (temperature-scaled, untruncated).
    """
    logp = torch.log_softmax(logits.float() * inv_temperature, dim=-1)
    probs = logp.exp()
    if top_p is not None and top_k is not None:
        probs = probs * nucleus_mask(probs, top_p, top_k)
    # clamp: a zero draw would turn a zero probability into 0/0 = NaN, which argmax would pick
    choice = (probs / noise.clamp_min(1e-30)).argmax(dim=-1)
    tokens = torch.where(greedy, logits.argmax(dim=-1), choice)
    return tokens, logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
