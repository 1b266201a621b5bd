"""FSDPPlugin (torch FSDP2) on 2 gloo ranks equals the single-process fp32 reference (Core v2 §2)."""

from __future__ import annotations

import pytest
import torch

from megalith.booster import Booster
from megalith.booster.plugins import FSDPPlugin
from megalith.common.errors import ConfigError
from megalith.testing import assert_states_close, run_distributed
from megalith.testing.loops import boosted_steps, reference_steps
from megalith.testing.models import WithUnused, synthetic_batches

STEPS, GLOBAL_BATCH, SEQ, LR, WD, EPS = 3, 8, 12, 1e-3, 0.1, 1e-6
VARIANTS = {"plain": {}, "accum3": {"accum": 3}, "clip": {"clip": 0.05}, "tied": {"tie": True}}


def reference(v: dict) -> dict[str, torch.Tensor]:
    accum = v.get("accum", 1)
    model = WithUnused(tie=v.get("tie", False))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, eps=EPS)
    reference_steps(model, opt, synthetic_batches(STEPS * accum, GLOBAL_BATCH, SEQ), accum, v.get("clip"))
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def train_fsdp(rank: int, world: int, v: dict) -> dict[str, torch.Tensor]:
    accum = v.get("accum", 1)
    model = WithUnused(tie=v.get("tie", False))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, eps=EPS)
    plugin = FSDPPlugin(group_size_mb=0.01)
    booster = Booster(plugin)
    model, opt, *_ = booster.boost(model, opt)
    batches = synthetic_batches(STEPS * accum, GLOBAL_BATCH, SEQ)
    boosted_steps(booster, model, opt, batches, rank, world, accum, v.get("clip"))
    if v.get("tie"):
        assert model.lm.lm_head.weight is model.lm.model.embed_tokens.weight
    full = dict(plugin.export_state(model))
    names = {n for n, _ in model.named_parameters()}
    return {n: t.clone() for n, t in full.items() if n in names}


def fsdp_worker(rank: int, world: int) -> dict[str, dict[str, torch.Tensor]]:
    return {name: train_fsdp(rank, world, v) for name, v in VARIANTS.items()}


def test_fsdp_matches_single_process() -> None:
    results = run_distributed(fsdp_worker, 2, timeout_s=240)
    for name, v in VARIANTS.items():
        ref = reference(v)
        for rank, states in enumerate(results):
            if v.get("tie"):  # the tied head is exported once, under the embedding's name
                ref = {k: t for k, t in ref.items() if k != "lm.lm_head.weight"}
            try:
                assert_states_close(states[name], ref, atol=1e-5)
            except AssertionError as exc:
                raise AssertionError(f"FSDP variant={name} rank={rank}: {exc}") from None


def test_fsdp_needs_a_process_group() -> None:
    model = WithUnused()
    with pytest.raises(ConfigError, match="FSDPPlugin needs an initialised process group"):
        Booster(FSDPPlugin()).boost(model, torch.optim.AdamW(model.parameters()))
    with pytest.raises(ConfigError, match="group_size_mb must be > 0, got 0"):
        FSDPPlugin(group_size_mb=0)
