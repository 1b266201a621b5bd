"""precision="bf16-true" (bf16 weights, gradients and optimizer states, no masters) and the one-rank
ZeRO-1/2 path (no flat buckets): equal to the plain loop they replace, planned, refused elsewhere."""

from __future__ import annotations

import pytest
import torch

from megalith.booster import Booster, plan
from megalith.booster.plugins import DDPPlugin, FSDPPlugin, ZeroPlugin
from megalith.common.errors import ConfigError
from megalith.testing import max_abs_diff, run_distributed, state_of
from megalith.testing.models import tiny_llama


def _batches(world: int, steps: int = 2) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 131, (2 * world, 8), generator=g) for _ in range(steps)]


def _reference(precision_dtype: torch.dtype, opt_cls: type, world: int, **opt_kw) -> dict[str, torch.Tensor]:
    """The plain loop: the model cast to the dtype, a torch optimizer on its parameters, full batches."""
    model = tiny_llama().to(precision_dtype)
    opt = opt_cls(model.parameters(), **opt_kw)
    for ids in _batches(world):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    return state_of(model)


def _boosted_steps(rank: int, world: int, plugin: object, precision: str, opt_cls: type, opt_kw: dict):
    model = tiny_llama()
    booster = Booster(plugin, precision=precision)  # type: ignore[arg-type]
    model, opt, *_ = booster.boost(model, opt_cls(model.parameters(), **opt_kw))
    for ids in _batches(world):
        local = ids[2 * rank : 2 * rank + 2] if world > 1 else ids
        booster.backward(model(input_ids=local, labels=local).loss, opt)
        opt.step()
        opt.zero_grad()
    inner = booster.unwrap(model)
    states = [t for s in opt.optim.state.values() for t in s.values() if t.numel() > 1]
    return (
        state_of(inner),
        [p.dtype for p in inner.parameters()],
        [t.dtype for t in states],
        [p._base is None for p in inner.parameters()],
    )


@pytest.mark.parametrize("plugin", [DDPPlugin(), ZeroPlugin(stage=2)], ids=["ddp", "zero2"])
def test_one_process_bf16_true_is_the_plain_bf16_loop(plugin):
    kw = {"lr": 1e-3, "weight_decay": 0.1}
    want = _reference(torch.bfloat16, torch.optim.AdamW, 1, **kw)
    got, param_dtypes, state_dtypes, plain = _boosted_steps(0, 1, plugin, "bf16-true", torch.optim.AdamW, kw)
    assert max_abs_diff(got, want) == 0.0
    assert set(param_dtypes) == {torch.bfloat16} and set(state_dtypes) == {torch.bfloat16}
    assert all(plain)  # one rank: parameters are ordinary tensors, not views of a flat bucket


def test_one_process_zero2_equals_ddp_fp32():
    kw = {"lr": 1e-3}
    zero = _boosted_steps(0, 1, ZeroPlugin(stage=2), "fp32", torch.optim.AdamW, kw)[0]
    ddp = _boosted_steps(0, 1, DDPPlugin(), "fp32", torch.optim.AdamW, kw)[0]
    assert max_abs_diff(zero, ddp) == 0.0


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_bf16_true_on_two_ranks_matches_full_batch(stage):
    """SGD (not Adam, whose update hides a wrong gradient scale): bf16 rounding of the reduced
    gradients is the only difference from the one-process full-batch loop."""
    kw = {"lr": 0.5}
    want = _reference(torch.bfloat16, torch.optim.SGD, 2, **kw)
    results = run_distributed(
        _boosted_steps, 2, ZeroPlugin(stage=stage, bucket_size_mb=0.01), "bf16-true", torch.optim.SGD, kw
    )
    for got, param_dtypes, _, _ in results:
        assert set(param_dtypes) == {torch.bfloat16}
        assert max_abs_diff(got, want) < 2e-2
    assert max_abs_diff(results[0][0], results[1][0]) == 0.0


def test_plan_of_bf16_true():
    model = tiny_llama()
    psi = sum(t.numel() for t in model.parameters())
    # bf16 params 2Ψ + bf16 grads 2Ψ + two bf16 Adam moments 4Ψ; ZeRO-2 shards grads and moments
    assert plan(model, DDPPlugin(), 4, "bf16-true").total == pytest.approx(8 * psi, rel=1e-3)
    assert plan(model, ZeroPlugin(stage=2), 4, "bf16-true").total == pytest.approx(
        (2 + 6 / 4) * psi, rel=1e-3
    )


def test_bf16_true_is_refused_where_not_implemented():
    with pytest.raises(ConfigError, match="'bf16-true' .* not fsdp"):
        Booster(FSDPPlugin(), precision="bf16-true")
    with pytest.raises(ConfigError, match="'bf16-true' .* not zero3"):
        Booster(ZeroPlugin(stage=3), precision="bf16-true")
