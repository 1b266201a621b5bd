"""fp16 overflow synchronisation (§4) and measured model-state bytes vs plan() (§3)."""

from __future__ import annotations

import pytest
import torch

from megalith.booster import Booster, plan
from megalith.booster.plugins import DDPPlugin, ZeroPlugin
from megalith.common.errors import ConfigError
from megalith.testing import run_distributed, state_of
from megalith.testing.models import tiny_llama


def fp16_overflow_worker(rank, world, plugin_name):
    plugin = ZeroPlugin(stage=2, bucket_size_mb=0.01) if plugin_name == "zero2" else DDPPlugin()
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    booster = Booster(plugin, precision="fp16")
    model, opt, *_ = booster.boost(model, opt)
    ids = torch.randint(0, 131, (2, 8), generator=torch.Generator().manual_seed(rank))
    scale_before = opt.scaler.scale
    before = state_of(booster.unwrap(model))
    booster.backward(model(input_ids=ids, labels=ids).loss, opt)
    if rank == 0:  # an overflow on one rank only
        if plugin_name == "zero2":
            opt.buckets[0].grad_shard[0] = float("inf")
        else:
            next(p for p in booster.unwrap(model).parameters()).grad.view(-1)[0] = float("inf")
    stepped = opt.step()
    opt.zero_grad()
    after = state_of(booster.unwrap(model))
    unchanged = all(torch.equal(before[k], after[k]) for k in before)
    # A clean step afterwards does update.
    booster.backward(model(input_ids=ids, labels=ids).loss, opt)
    stepped_clean = opt.step()
    return stepped, unchanged, scale_before, opt.scaler.scale, stepped_clean


@pytest.mark.parametrize("plugin_name", ["zero2", "ddp"])
def test_fp16_inf_on_one_rank_skips_everywhere(plugin_name):
    results = run_distributed(fp16_overflow_worker, 2, plugin_name)
    for stepped, unchanged, before, after, stepped_clean in results:
        assert stepped is False
        assert unchanged
        assert after == before / 2
        assert stepped_clean is True


def measured_bytes(rank, world, stage, precision):
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    booster = Booster(ZeroPlugin(stage=stage, bucket_size_mb=0.05), precision=precision)
    model, opt, *_ = booster.boost(model, opt)
    ids = torch.randint(0, 131, (2, 8))
    booster.backward(model(input_ids=ids, labels=ids).loss, opt)
    opt.step()
    return opt.memory_bytes()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize(("stage", "world"), [(1, 2), (1, 4), (2, 2), (2, 4)])
def test_measured_state_bytes_match_plan(stage, world, precision):
    measured = run_distributed(measured_bytes, world, stage, precision)[0]
    p = plan(tiny_llama(), ZeroPlugin(stage=stage), world_size=world, precision=precision)
    # Formula by hand: Ψ params; fp32 Adam states 8Ψ/N (+4Ψ/N fp32 master under mixed precision).
    psi = sum(t.numel() for t in tiny_llama().parameters())
    grad_bytes = 4 if precision == "fp32" else 2
    expected_grads = grad_bytes * psi / (1 if stage == 1 else world)
    expected_states = (8 if precision == "fp32" else 12) * psi / world
    assert p.grads == pytest.approx(expected_grads, rel=1e-3)
    assert p.optimizer_states == pytest.approx(expected_states, rel=1e-3)
    assert measured["grads"] == pytest.approx(p.grads, rel=0.05)
    assert measured["optimizer_states"] == pytest.approx(p.optimizer_states, rel=0.05)


def test_plan_formulas_for_all_plugins():
    model = tiny_llama()
    psi = sum(t.numel() for t in model.parameters())
    n = 8
    for plugin, precision, per_param in [
        (DDPPlugin(), "fp32", 16),
        (DDPPlugin(), "bf16", 16),
        (ZeroPlugin(stage=1), "fp32", 8 + 8 / n),
        (ZeroPlugin(stage=2), "fp32", 4 + 12 / n),
        (ZeroPlugin(stage=1), "bf16", 4 + 12 / n),
        (ZeroPlugin(stage=2), "bf16", 2 + 14 / n),
    ]:
        assert plan(model, plugin, n, precision).total == pytest.approx(per_param * psi, rel=1e-3), (
            plugin.name,
            precision,
        )
    offload = plan(model, ZeroPlugin(stage=2, cpu_offload=True), n, "bf16")
    assert offload.optimizer_states == 0 and offload.host == pytest.approx(12 * psi / n, rel=1e-3)
    assert "optimizer states" in str(offload)


def test_plan_rejects_bad_configuration():
    with pytest.raises(ConfigError, match="world_size must be a positive integer, got 0"):
        plan(tiny_llama(), DDPPlugin(), world_size=0)
    with pytest.raises(ConfigError, match="precision must be one of .* got 'fp8'"):
        plan(tiny_llama(), DDPPlugin(), world_size=2, precision="fp8")
    with pytest.raises(ConfigError, match=r"ZeRO stage must be one of \(1, 2, 3\), got 4"):
        ZeroPlugin(stage=4)


def test_plan_allocates_nothing_on_meta_device():
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        big = LlamaForCausalLM(
            LlamaConfig(
                hidden_size=2048,
                intermediate_size=5632,
                num_hidden_layers=22,
                num_attention_heads=32,
                num_key_value_heads=4,
                vocab_size=32000,
            )
        )
    p = plan(big, ZeroPlugin(stage=2), world_size=8, precision="bf16")
    assert 1.0e9 < p.num_params < 1.2e9
    assert p.total == pytest.approx((2 + 14 / 8) * p.num_params, rel=1e-3)
