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


def _lora_reference(rank: int, world: int) -> tuple[float, float]:
    """A LoRA policy (non-zero adapters) with kl_coef > 0 and no reference model: the learner's
    reference log-probs against the base model's and against the adapted policy's (max |diff|)."""
    from peft import LoraConfig, get_peft_model

    from megalith_chat.rollout.generation import response_logprobs

    base = tiny_llama(seed=0, vocab_size=VOCAB)
    plain = copy.deepcopy(base)
    torch.manual_seed(1)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    policy = get_peft_model(base, lora)
    booster = make_booster("zero2", "fp32")
    policy, optimizer, *_ = booster.boost(policy, make_optimizer(policy, LR))
    config = LearnerConfig(loss=PolicyLossConfig(kl_coef=0.1), micro_batch_size=4, track_kl=True)
    learner = GRPOLearner(policy, optimizer, booster, config)
    batch = _batch()
    args = (batch.prompt_ids, batch.prompt_mask, batch.response_ids, batch.response_mask)
    rows = dict(zip(("prompt_ids", "prompt_mask", "response_ids", "response_mask"), args, strict=True))
    ref = learner._ref_logprobs(rows)
    assert ref is not None
    with torch.no_grad():
        want, adapted = response_logprobs(plain, *args), response_logprobs(policy, *args)
    return float((ref - want).abs().max()), float((ref - adapted).abs().max())


def test_lora_reference_is_the_base_model() -> None:
    """kl_coef > 0 on a LoRA policy without a reference model: the reference is the base model (the
    adapter switched off), not the adapted policy."""
    to_base, to_policy = run_distributed(_lora_reference, 1)[0]
    assert to_base < 1e-6
    assert to_policy > 1e-3  # the adapters change the policy, so the comparison can tell them apart
