"""`plan()` under pipeline parallelism: each pp rank counts only the parameters of its own stages.

One 2-rank run (pp=2 × dp=1) boosts two tiny Llamas and takes one step: a 3-layer model with tied
embeddings under 1F1B and ZeRO-2 (an uneven split; the embedding is held by both ranks) and a
4-layer untied model under interleaved 1F1B (v=2: stages 0, 2 on rank 0 and 1, 3 on rank 1) and
ZeRO-1. The measured bytes of each rank (its parameters; the optimizer's gradient buffers and Adam
states) equal `pipeline_memory_plans(...)[pp rank]` within 5% (parameters exactly), `plan()` reports
the larger rank, and the count-only formula no longer ignores pp."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from megalith.booster import Booster, plan
from megalith.booster.plugins import HybridPlugin
from megalith.booster.plugins.hybrid_plan import pipeline_memory_plans
from megalith.booster.precision import Precision
from megalith.testing import run_distributed
from megalith.testing.models import tiny_llama

VOCAB, SEQ = 64, 8
CASES = {
    "tied_1f1b_zero2": ({"layers": 3, "tie": True}, {"pp_schedule": "1f1b", "zero_stage": 2}),
    "interleaved_zero1": (
        {"layers": 4, "tie": False},
        {"pp_schedule": "interleaved", "num_model_chunks": 2, "zero_stage": 1},
    ),
}


def _plugin(options: dict[str, Any]) -> HybridPlugin:
    return HybridPlugin(pp_size=2, num_microbatches=2, **options)


def _measure(model_kwargs: dict[str, Any], options: dict[str, Any]) -> dict[str, int]:
    model = tiny_llama(vocab_size=VOCAB, **model_kwargs)
    booster = Booster(_plugin(options))
    model, opt, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    ids = torch.randint(0, VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(4))
    booster.execute_pipeline(iter([{"input_ids": ids}]), model, None, opt)
    opt.step()
    measured = opt.memory_bytes()
    unique = {id(p): p for p in model.parameters()}.values()
    measured["params"] = sum(p.numel() * p.element_size() for p in unique)
    return measured


def worker(rank: int, world: int) -> dict[str, dict[str, int]]:
    return {name: _measure(*case) for name, case in CASES.items()}


def test_pp_plan_counts_each_ranks_stages_and_matches_measured_bytes() -> None:
    results = run_distributed(worker, 2, timeout_s=180)
    for name, (model_kwargs, options) in CASES.items():
        model = tiny_llama(vocab_size=VOCAB, **model_kwargs)
        plugin = _plugin(options)
        plans = pipeline_memory_plans(
            plugin.name, model, plugin.plan_for(model), plugin.config, 2, Precision("fp32")
        )
        assert len(plans) == 2
        for pp_rank, measured in enumerate(results):
            got, want = measured[name], plans[pp_rank]
            assert want.params == got["params"], (name, pp_rank)  # exact: the stage's own parameters
            assert got["grads"] == pytest.approx(want.grads, rel=0.05), (name, pp_rank)
            assert got["optimizer_states"] == pytest.approx(want.optimizer_states, rel=0.05), (name, pp_rank)
        whole = sum(p.numel() for p in model.parameters()) * 4
        if model_kwargs["tie"]:  # the embedding counts on both ranks
            emb = model.get_input_embeddings().weight.numel() * 4
            assert plans[0].params + plans[1].params == whole + emb
        else:
            assert plans[0].params + plans[1].params == whole
        largest = max(plans, key=lambda p: p.total)
        assert plan(model, plugin, world_size=2) == largest
        assert largest.params < whole  # not the unpipelined count


def test_count_only_formula_divides_by_pp() -> None:
    one, two = HybridPlugin(), HybridPlugin(pp_size=2)
    args = (1_000_000, 1_000_000, 2, Precision("fp32"))
    assert (
        two.memory_plan(*args).params
        == one.memory_plan(1_000_000, 1_000_000, 1, Precision("fp32")).params // 2
    )
