"""Static buffers of the fast engine's decode step (inputs, counters, outputs of a CUDA graph).

A captured graph reads and writes fixed addresses, so everything a step touches is allocated once
here at ``max_batch`` rows and filled in place by :meth:`DecodeState.prepare` before each call.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megalith.common.errors import ConfigError
from megalith_chat.engine.sampling import SamplingParams

MAX_EOS = 8  # end-of-sequence ids a call may give; unused entries hold -1 (matches no token)


class DecodeState:
    """Per-row sampling parameters, the token fed next, counters and the output record.

    * ``tok [B]`` next input token; ``start [B]`` first prompt slot of each row (left padding);
    * ``slot`` (0-d) cache slot of ``tok``; ``ridx`` (0-d) output column of the next sample;
      ``prompt_end`` (0-d) the prompt width ``P`` (where rows sharing a prompt start to differ);
      ``seed`` (0-d) the call's Philox seed (:mod:`.fast_sample`);
    * ``inv_t, top_p [B, 1]`` float, ``top_k [B, 1]`` long, ``greedy [B]`` bool, ``noise [B, V]``;
    * ``done [B]`` bool; ``out_tok [B, max_len]`` long and ``out_lp [B, max_len]`` float32.
    """

    def __init__(self, max_batch: int, max_len: int, vocab: int, device: torch.device) -> None:
        b = max_batch
        self.tok = torch.zeros(b, dtype=torch.long, device=device)
        self.start = torch.zeros(b, dtype=torch.long, device=device)
        self.slot = torch.zeros((), dtype=torch.long, device=device)
        self.ridx = torch.zeros((), dtype=torch.long, device=device)
        self.prompt_end = torch.zeros((), dtype=torch.long, device=device)
        self.seed = torch.zeros((), dtype=torch.long, device=device)
        self.pad = torch.zeros((), dtype=torch.long, device=device)
        self.eos = torch.full((MAX_EOS,), -1, dtype=torch.long, device=device)
        self.inv_t = torch.ones(b, 1, device=device)
        self.top_p = torch.ones(b, 1, device=device)
        self.top_k = torch.zeros(b, 1, dtype=torch.long, device=device)
        self.greedy = torch.zeros(b, dtype=torch.bool, device=device)
        self.noise = torch.ones(b, vocab, device=device)
        self.done = torch.zeros(b, dtype=torch.bool, device=device)
        self.out_tok = torch.zeros(b, max_len, dtype=torch.long, device=device)
        self.out_lp = torch.zeros(b, max_len, device=device)
        self.arange = torch.arange(max_len, device=device)
        self.device = device

    def prepare(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        rows: int,
        params: SamplingParams,
        eos_ids: Sequence[int],
        pad_id: int,
    ) -> torch.Tensor:
        """Fill the buffers for a call of ``B`` prompts run as ``rows >= B`` rows; returns ``start [rows]``.

        ``prompt_mask`` must be left padding (each row's ones contiguous at the end); the dummy
        rows ``B..rows-1`` get a one-token prompt at the last slot and finish immediately.
        """
        if len(eos_ids) > MAX_EOS:
            raise ConfigError(f"at most {MAX_EOS} end-of-sequence ids are supported, got {list(eos_ids)}")
        batch, width = prompt_ids.shape
        mask = prompt_mask.to(torch.long).cpu()
        lengths = mask.sum(dim=1)
        if bool((lengths < 1).any()):
            raise ConfigError("every prompt needs at least one token (a row of prompt_mask is all zero)")
        expected = torch.arange(width).unsqueeze(0) >= (width - lengths).unsqueeze(1)
        if not torch.equal(mask.bool(), expected):
            raise ConfigError(
                "prompt_mask must describe left padding (ones contiguous at the end of each row)"
            )
        start = torch.full((rows,), width - 1, dtype=torch.long)
        start[:batch] = width - lengths
        self.start[:rows].copy_(start)
        self.eos.fill_(-1)
        if eos_ids:
            self.eos[: len(eos_ids)].copy_(torch.tensor(list(eos_ids), dtype=torch.long))
        self.pad.fill_(pad_id)
        self.inv_t[:rows].fill_(1.0 if params.greedy else 1.0 / params.temperature)
        self.top_p[:rows].fill_(params.top_p)
        self.top_k[:rows].fill_(params.top_k)
        self.greedy[:rows].fill_(params.greedy)
        self.done[:rows].fill_(False)
        self.done[batch:rows].fill_(True)
        self.ridx.fill_(0)
        return self.start[:rows]

    def prompt_rows(self, prompt_ids: torch.Tensor, rows: int, pad_id: int) -> torch.Tensor:
        """``prompt_ids`` on the device, padded with dummy rows (all ``pad_id``) up to ``rows``."""
        ids = prompt_ids.to(self.device, torch.long)
        if rows == ids.shape[0]:
            return ids
        extra = torch.full((rows - ids.shape[0], ids.shape[1]), pad_id, dtype=torch.long, device=self.device)
        return torch.cat([ids, extra])
