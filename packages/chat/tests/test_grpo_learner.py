"""GRPO learner: dp=1 and dp=2 (ZeRO-2, gloo) give the same update, equal to a hand-written reference."""

from __future__ import annotations

import copy

import torch

from megalith.testing import run_distributed
from megalith.testing.models import tiny_llama
from megalith_chat.algorithms import PolicyLossConfig
from megalith_chat.messages import RolloutBatch
from megalith_chat.testing import LR, VOCAB, grpo_batch, grpo_reference_update
from megalith_chat.trainer.grpo import GRPOLearner, LearnerConfig
from megalith_chat.trainer.setup import make_booster, make_optimizer


def _batch() -> RolloutBatch:
    return grpo_batch(tiny_llama(seed=0, vocab_size=VOCAB))  # ratio 1 at the start: old = initial policy


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
    after = grpo_reference_update(tiny_llama(seed=0, vocab_size=VOCAB), _batch())
    return torch.cat([p.flatten() for p in after.values()])


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
