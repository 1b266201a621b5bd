"""GRPO learner: dp=1 and dp=2 (ZeRO-2, gloo) give the same update, equal to a hand-written reference."""

from __future__ import annotations

import copy

import torch

from megalith.testing import run_distributed
from megalith.testing.models import tiny_llama
from megalith_chat.algorithms import PolicyLossConfig
from megalith_chat.messages import RolloutBatch
from megalith_chat.rollout.generation import response_logprobs
from megalith_chat.trainer.grpo import GRPOLearner, LearnerConfig
from megalith_chat.trainer.setup import make_booster, make_optimizer

VOCAB, G, PROMPTS, P, R, LR = 61, 4, 2, 5, 6, 1e-2


def _batch() -> RolloutBatch:
    g = torch.Generator().manual_seed(3)
    b = G * PROMPTS
    prompt_ids = torch.randint(2, VOCAB, (b, P), generator=g)
    prompt_mask = torch.ones(b, P, dtype=torch.long)
    prompt_mask[0, :2] = 0  # a left-padded prompt
    response_ids = torch.randint(2, VOCAB, (b, R), generator=g)
    lengths = torch.randint(2, R + 1, (b,), generator=g)
    response_mask = (torch.arange(R)[None, :] < lengths[:, None]).long()
    model = tiny_llama(seed=0, vocab_size=VOCAB)
    with torch.no_grad():  # behaviour log-probs = the initial policy's (PPO ratio 1 at the start)
        old = response_logprobs(model, prompt_ids, prompt_mask, response_ids, response_mask)
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.0, 1.0, 1.0, 0.0, 0.2])
    return RolloutBatch(prompt_ids, prompt_mask, response_ids, response_mask, old, rewards, G, 0, 0)


def _learner_step(rank: int, world: int, micro: int) -> list[float]:
    torch.manual_seed(0)
    model = tiny_llama(seed=0, vocab_size=VOCAB)
    booster = make_booster("zero2", "fp32")
    model, optimizer, *_ = booster.boost(model, make_optimizer(model, LR))
    config = LearnerConfig(loss=PolicyLossConfig(), micro_batch_size=micro, max_grad_norm=1.0, track_kl=False)
    GRPOLearner(model, optimizer, booster, config).step(_batch())
    return torch.cat([p.detach().flatten() for p in booster.unwrap(model).parameters()]).tolist()


def _reference_update() -> torch.Tensor:
    """Independent reference: token-mean of -A_i * ratio over the whole batch, AdamW, clip 1.0."""
    batch = _batch()
    model = tiny_llama(seed=0, vocab_size=VOCAB)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.0)
    r = batch.rewards.view(PROMPTS, G)
    adv = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-6)).view(-1)
    logp = response_logprobs(
        model, batch.prompt_ids, batch.prompt_mask, batch.response_ids, batch.response_mask
    )
    mask = batch.response_mask.float()
    ratio = torch.exp(logp - batch.rollout_logprobs)
    loss = -(adv[:, None] * ratio * mask).sum() / mask.sum()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_dp1_and_dp2_give_the_same_update_as_the_reference() -> None:
    before = torch.cat(
        [p.detach().flatten() for p in copy.deepcopy(tiny_llama(seed=0, vocab_size=VOCAB)).parameters()]
    )
    dp1 = torch.tensor(run_distributed(_learner_step, 1, 3)[0])  # 3-row micro-batches: 3 + 3 + 2
    dp2 = run_distributed(_learner_step, 2, 2)
    reference = _reference_update()
    assert (dp1 - before).abs().max() > 1e-3  # the step really moved the weights
    torch.testing.assert_close(torch.tensor(dp2[0]), torch.tensor(dp2[1]), atol=0, rtol=0)
    torch.testing.assert_close(torch.tensor(dp2[0]), dp1, atol=1e-5, rtol=0)
    torch.testing.assert_close(dp1, reference, atol=1e-5, rtol=0)


def test_shuffled_advantages_are_a_permutation() -> None:
    from megalith_chat.trainer.grpo import compute_advantages

    batch = _batch()
    plain = compute_advantages(batch, LearnerConfig(), step=0)
    shuffled = compute_advantages(batch, LearnerConfig(shuffle_advantages=True), step=0)
    assert not torch.equal(plain, shuffled)
    torch.testing.assert_close(plain.sort().values, shuffled.sort().values)
