"""ZeRO-1/2 on 2 and 4 gloo ranks (and its one-rank path) equal a single-process fp32 reference (acceptance 1/2 of core v1)."""

from __future__ import annotations

from contextlib import nullcontext
from functools import cache

import pytest
import torch

from megalith.booster import Booster
from megalith.booster.plugins import DDPPlugin, ZeroPlugin
from megalith.testing import assert_states_close, run_distributed, state_of
from megalith.testing.loops import boosted_steps, lm_loss, reference_steps
from megalith.testing.models import WithUnused, synthetic_batches
from megalith.zero import ZeroConfig, ZeroOptimizer

STEPS, GLOBAL_BATCH, SEQ, LR, WD, EPS = 3, 8, 12, 1e-3, 0.1, 1e-6
VARIANTS = {
    "plain": {},
    "overlap": {"overlap": True},
    "offload": {"offload": True},
    "accum4": {"accum": 4},
    "clip": {"clip": 0.05},
    "tied": {"tie": True, "overlap": True},
}


def _batches(accum: int) -> list[torch.Tensor]:
    return synthetic_batches(STEPS * accum, GLOBAL_BATCH, SEQ)


@cache
def reference(variant: str) -> dict[str, torch.Tensor]:
    """Plain torch, one process, the whole global batch (accumulation: 4 micro-batches of loss/4)."""
    v = VARIANTS[variant]
    accum = v.get("accum", 1)
    model = WithUnused(tie=v.get("tie", False))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, eps=EPS)
    reference_steps(model, opt, _batches(accum), accum, v.get("clip"))
    return state_of(model)


def train_boosted(rank: int, world: int, plugin, variant: str) -> dict[str, torch.Tensor]:
    v = VARIANTS[variant]
    accum = v.get("accum", 1)
    model = WithUnused(tie=v.get("tie", False))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, eps=EPS)
    booster = Booster(plugin)
    model, opt, *_ = booster.boost(model, opt)
    boosted_steps(booster, model, opt, _batches(accum), rank, world, accum, v.get("clip"))
    if "tie" in v and v["tie"]:
        lm = booster.unwrap(model).lm
        assert lm.lm_head.weight is lm.model.embed_tokens.weight
    return state_of(booster.unwrap(model))


def zero_worker(rank: int, world: int, stage: int) -> dict[str, dict[str, torch.Tensor]]:
    out = {}
    for name, v in VARIANTS.items():
        plugin = ZeroPlugin(
            stage=stage,
            bucket_size_mb=0.01,  # ~2.6k fp32 elements: many buckets, sizes not divisible by world
            overlap_communication=v.get("overlap", False),
            cpu_offload=v.get("offload", False),
        )
        out[name] = train_boosted(rank, world, plugin, name)
    return out


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("stage", [1, 2])
def test_zero_matches_single_process(stage: int, world: int) -> None:
    results = run_distributed(zero_worker, world, stage, timeout_s=240)
    for name in VARIANTS:
        ref = reference(name)
        for rank, states in enumerate(results):
            try:
                assert_states_close(states[name], ref, atol=1e-5)
            except AssertionError as exc:
                raise AssertionError(f"ZeRO-{stage} dp={world} variant={name} rank={rank}: {exc}") from None
        # The never-used parameter must not move (a torch optimizer skips grad=None).
        assert torch.equal(results[0][name]["unused.weight"], ref["unused.weight"])


def ddp_worker(rank: int, world: int) -> dict[str, dict[str, torch.Tensor]]:
    return {
        name: train_boosted(rank, world, DDPPlugin(find_unused_parameters=True), name)
        for name in ("plain", "accum4", "clip")
    }


def test_ddp_matches_single_process() -> None:
    results = run_distributed(ddp_worker, 2, timeout_s=180)
    for name in ("plain", "accum4", "clip"):
        for states in results:
            assert_states_close(states[name], reference(name), atol=1e-6)


# -- accumulation over several synchronised backwards (no `no_sync`) --------------------------------
SYNC_PATTERN = (True, False, True, True)  # per micro-batch: reduce after its backward (False: no_sync)


def _accumulate(booster, model, opt, ids_of, pattern=SYNC_PATTERN) -> None:
    """STEPS steps of 4 micro-batches of loss/4, reduced after the backwards marked in `pattern`
    (the last one always is): 2-3 reductions per step add into the same gradients."""
    for step in range(STEPS):
        for micro, sync in enumerate(pattern):
            ids = ids_of(step * len(pattern) + micro)
            with nullcontext() if sync else booster.no_sync(model, opt):
                booster.backward(lm_loss(model, ids) / len(pattern), opt)
        opt.step()
        opt.zero_grad()


def sync_accum_worker(rank: int, world: int) -> dict[str, dict[str, torch.Tensor]]:
    batches, per = _batches(4), GLOBAL_BATCH // world
    out = {}
    for stage in (1, 2):
        for overlap in (False, True):
            plugin = ZeroPlugin(stage=stage, bucket_size_mb=0.01, overlap_communication=overlap)
            model = WithUnused()
            opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, eps=EPS)
            booster = Booster(plugin)
            model, opt, *_ = booster.boost(model, opt)
            _accumulate(booster, model, opt, lambda i: batches[i][rank * per : (rank + 1) * per])
            out[f"stage{stage} overlap={overlap}"] = state_of(booster.unwrap(model))
    return out


def test_zero_accumulates_over_synchronised_backwards() -> None:
    """Several reductions per step (no `no_sync`) sum like DDP: ZeRO-2 adds later reductions into
    the gradient shard, ZeRO-1 reduces from a clean buffer; with and without overlap."""
    results = run_distributed(sync_accum_worker, 2, timeout_s=240)
    for rank, states in enumerate(results):
        for name, state in states.items():
            try:
                assert_states_close(state, reference("accum4"), atol=1e-5)
            except AssertionError as exc:
                raise AssertionError(f"{name} rank {rank}: {exc}") from None


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("stage", [1, 2])
def test_zero_optimizer_on_one_rank_accumulates_over_synchronised_backwards(
    stage: int, overlap: bool
) -> None:
    model, opt = _one_rank_zero(stage, overlap)
    booster = Booster(DDPPlugin())  # only for its no_sync verb on the bare optimizer
    batches = _batches(4)
    _accumulate(booster, model, opt, lambda i: batches[i])
    assert_states_close(state_of(model), reference("accum4"), atol=1e-5)


def _one_rank_zero(stage: int, overlap: bool) -> tuple[WithUnused, ZeroOptimizer]:
    """ZeroOptimizer with a dp group of one (as under TP-only hybrid layouts): no reduction, the
    gradients are packed straight into the shards."""
    model = WithUnused()
    inner = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, eps=EPS)
    config = ZeroConfig(stage=stage, bucket_size_mb=0.01, overlap_communication=overlap)
    names = {p: n for n, p in model.named_parameters()}
    return model, ZeroOptimizer(inner, names, config, master_dtype=torch.float32)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("stage", [1, 2])
def test_zero_optimizer_on_one_rank_matches_single_process(stage: int, overlap: bool) -> None:
    model, opt = _one_rank_zero(stage, overlap)
    for ids in _batches(1):
        opt.backward(lm_loss(model, ids))
        opt.step()
        opt.zero_grad()
    assert_states_close(state_of(model), reference("plain"), atol=1e-5)


@pytest.mark.parametrize("stage", [1, 2])
def test_step_without_backward_after_zero_grad_moves_nothing(stage: int) -> None:
    """Stage 2 leaves its gradient shards stale at zero_grad (the next reduction overwrites them);
    a step before any backward must still see zero gradients and leave every parameter alone."""
    model, opt = _one_rank_zero(stage, overlap=True)
    ids = _batches(1)[0]
    opt.backward(lm_loss(model, ids))
    opt.step()
    opt.zero_grad()
    before = state_of(model)
    assert opt.clip_grad_by_norm(1.0) == 0.0
    opt.step()
    after = state_of(model)
    for name, value in before.items():
        assert torch.equal(after[name], value), name


def test_reference_actually_trains() -> None:
    """Guard against a vacuous comparison: 3 steps move every used parameter."""
    start = state_of(WithUnused())
    end = reference("plain")
    moved = [k for k in start if not torch.equal(start[k], end[k])]
    assert set(start) - set(moved) == {"unused.weight", "unused.bias"}
