"""A small GRPO problem for the parallel-equivalence tests (tp, pp): one rollout batch of G = 4
samples for each of 2 prompts (5 prompt + 6 response tokens) over a tiny Llama, and the
single-process update a parallel learner must reproduce."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from megalith_chat.messages import RolloutBatch
from megalith_chat.rollout.generation import response_logprobs

VOCAB, G, PROMPTS, P, R, LR = 61, 4, 2, 5, 6, 1e-2  # prompt + response = 11 tokens: odd on purpose


def grpo_batch(
    model: nn.Module, left_pad: Sequence[tuple[int, int]] = ((0, 2),), logprob_shift: float = 0.0
) -> RolloutBatch:
    """Random prompts and responses (seed 3; `left_pad` = (row, pad tokens) pairs), rollout
    log-probs from `model` minus `logprob_shift`, fixed rewards."""
    g = torch.Generator().manual_seed(3)
    b = G * PROMPTS
    prompt_ids = torch.randint(2, VOCAB, (b, P), generator=g)
    prompt_mask = torch.ones(b, P, dtype=torch.long)
    for row, pad in left_pad:
        prompt_mask[row, :pad] = 0
    response_ids = torch.randint(2, VOCAB, (b, R), generator=g)
    lengths = torch.randint(2, R + 1, (b,), generator=g)
    response_mask = (torch.arange(R)[None, :] < lengths[:, None]).long()
    with torch.no_grad():
        old = response_logprobs(model, prompt_ids, prompt_mask, response_ids, response_mask) - logprob_shift
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.0, 1.0, 1.0, 0.0, 0.2])
    return RolloutBatch(prompt_ids, prompt_mask, response_ids, response_mask, old, rewards, G, 0, 0)


def grpo_reference_update(model: nn.Module, batch: RolloutBatch) -> dict[str, torch.Tensor]:
    """One process: token-mean of -A_i * ratio over the batch (group-normalised advantages), global
    norm clipped to 1.0, one AdamW step; the parameters after it by name."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.0)
    r = batch.rewards.view(PROMPTS, G)
    adv = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-6)).view(-1)
    logp = response_logprobs(
        model, batch.prompt_ids, batch.prompt_mask, batch.response_ids, batch.response_mask
    )
    mask = batch.response_mask.float()
    loss = -(adv[:, None] * torch.exp(logp - batch.rollout_logprobs) * mask).sum() / mask.sum()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}
