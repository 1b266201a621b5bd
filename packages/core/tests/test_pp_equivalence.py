"""Pipeline parallelism through `HybridPlugin(pp_size=...)` and `booster.execute_pipeline`: every
schedule at pp=4 and at dp2×pp2 (gpipe / 1f1b / zb-h1 with ZeRO-0/1/2; interleaved with tied
embeddings), tp2×pp2 (zb-h1, activation checkpointing), a plain nn.Sequential, and dp2×tp2×pp2 on
8 ranks (Megatron-SP) equal one process training on the whole batch (losses and parameters after
3 steps with global-norm clipping, within 1e-5). A checkpoint written at pp2×tp2 after step 2 loads
in one process (pp1×tp1) with identical parameters and optimizer state (save_model / save_optimizer
and save_state / load_state) and at pp4 × ZeRO-2, and both continue to the reference's step 3; its
HF export loads with `from_pretrained`."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from transformers import LlamaForCausalLM

from megalith.booster import Booster
from megalith.booster.plugins import HybridPlugin
from megalith.common.errors import ConfigError
from megalith.pipeline.stage import balance_layers, stage_ranges
from megalith.tensor_parallel import TensorParallelPlan
from megalith.testing import run_distributed, state_of
from megalith.testing.models import lm_loss, synthetic_batches, tiny_llama

STEPS, BATCH, SEQ, VOCAB, LAYERS, LR, CLIP = 3, 8, 8, 64, 8, 1e-3, 0.05
SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("interleaved", 2))


def _batches() -> list[torch.Tensor]:
    return synthetic_batches(STEPS, BATCH, SEQ, vocab=VOCAB)


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1, eps=1e-6)


def _llama(tie: bool = False) -> nn.Module:
    return tiny_llama(vocab_size=VOCAB, layers=LAYERS, tie=tie)


@cache
def reference(steps: int, tie: bool = False) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, plain torch, the whole batch, clipped to CLIP: (losses, parameters)."""
    model = _llama(tie)
    opt = _optimizer(model)
    losses = []
    for ids in _batches()[:steps]:
        loss = lm_loss(model, ids)
        losses.append(loss.item())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
    return losses, state_of(model)


def _train(
    plugin: HybridPlugin, tie: bool = False, save: Path | None = None, load: Path | None = None
) -> dict:
    """3 pipelined steps on this dp rank's slice of the batch (or the last one after loading the
    checkpoint `load` of step 2); losses averaged over dp; the full parameters (gathered with the
    plugin's export, a collective) on global rank 0."""
    booster = Booster(plugin)
    model = _llama(tie)
    model, opt, *_ = booster.boost(model, _optimizer(model))
    if load is not None:
        booster.load_model(model, load / "model", opt)
        booster.load_optimizer(opt, load / "optim")
    dp, per = plugin.dp_size(), BATCH // plugin.dp_size()
    lo = plugin.dp_rank() * per
    losses = []
    for step, ids in enumerate(_batches()):
        if load is not None and step < 2:
            continue
        out = booster.execute_pipeline(iter([{"input_ids": ids[lo : lo + per]}]), model, None, opt)
        loss = out["loss"].clone()
        dist.all_reduce(loss, group=plugin.dp_group)
        losses.append(float(loss) / dp)
        opt.clip_grad_by_norm(CLIP)
        opt.step()
        opt.zero_grad()
        if save is not None and step == 1:
            booster.save_model(model, save / "model")
            booster.save_optimizer(opt, save / "optim")
            booster.save_state(save / "state", model, opt, step=2)
    state = {k: v.clone() for k, v in plugin.export_state(model)}
    return {"losses": losses, "state": state if dist.get_rank() == 0 else None}


def _sequential_run() -> dict:
    """nn.Sequential of 4 blocks at dp2×pp2 with an MSE criterion (no tp policy needed)."""
    torch.manual_seed(3)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(4)])
    plugin = HybridPlugin(
        pp_size=2, pp_schedule="1f1b", num_microbatches=2, policy=TensorParallelPlan(layers={})
    )
    booster = Booster(plugin)
    model, opt, *_ = booster.boost(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(5))
    lo = plugin.dp_rank() * 4
    batch = {"input": x[lo : lo + 4], "target": x[lo : lo + 4].flip(1)}
    out = booster.execute_pipeline(iter([batch]), model, lambda y, mb: ((y - mb["target"]) ** 2).mean(), opt)
    opt.step()
    return {"loss": float(out["loss"]), "state": {k: v.clone() for k, v in plugin.export_state(model)}}


def four_rank_worker(rank: int, world: int, root: str) -> dict:
    out = {}
    for name, v in SCHEDULES:
        out[f"pp4_{name}"] = _train(
            HybridPlugin(pp_size=4, pp_schedule=name, num_microbatches=4, num_model_chunks=v)
        )
    for stage, (name, v) in enumerate(SCHEDULES[:3]):
        plugin = HybridPlugin(
            pp_size=2, pp_schedule=name, num_microbatches=2, num_model_chunks=v, zero_stage=stage
        )
        out[f"dp2_pp2_{name}_zero{stage}"] = _train(plugin)
    # tied embeddings: stage 0 on pp rank 0, stage 3 (the LM head copy) on pp rank 1
    plugin = HybridPlugin(pp_size=2, pp_schedule="interleaved", num_microbatches=4, num_model_chunks=2)
    out["tied_dp2_pp2_interleaved"] = _train(plugin, tie=True)
    plugin = HybridPlugin(tp_size=2, pp_size=2, pp_schedule="zb-h1", num_microbatches=2, checkpoint_ratio=0.5)
    out["tp2_pp2"] = _train(plugin, save=Path(root))
    # the pp2×tp2 checkpoint of step 2 at pp4 (other stage boundaries, ZeRO-2): the same step 3
    loaded = _train(HybridPlugin(pp_size=4, num_microbatches=4, zero_stage=2), load=Path(root))
    out["pp4_loaded"] = {"losses": reference(STEPS)[0][:2] + loaded["losses"], "state": loaded["state"]}
    out["sequential"] = _sequential_run()
    return out


def _check(result: dict, tie: bool, what: str) -> None:
    losses, state = reference(STEPS, tie)
    assert result["losses"] == pytest.approx(losses, abs=1e-5), what
    assert result["state"].keys() == state.keys(), what
    for k, ref in state.items():
        diff = float((result["state"][k] - ref).abs().max())
        assert diff < 1e-5, f"{what} {k}: max |diff| {diff:.2e}"


def test_every_schedule_and_layout_matches_one_process(tmp_path: Path) -> None:
    results = run_distributed(four_rank_worker, 4, str(tmp_path), timeout_s=240)[0]
    for what, result in results.items():
        if what != "sequential":
            _check(result, what.startswith("tied"), what)
    assert not torch.equal(reference(STEPS)[1]["lm_head.weight"], _llama().lm_head.weight)
    # nn.Sequential: the same step in one process on the whole batch
    torch.manual_seed(3)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(4)])
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(5))
    loss = ((model(x) - x.flip(1)) ** 2).mean()
    loss.backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    seq = results["sequential"]
    for k, v in state_of(model).items():
        assert float((seq["state"][k] - v).abs().max()) < 1e-6, k
    _check_checkpoint(tmp_path)


def _check_checkpoint(root: Path) -> None:
    """Saved after 2 steps at tp2×pp2: loads at pp1×tp1 (one process) with identical parameters,
    and one more step with the loaded optimizer state reaches the reference's third step."""
    _, after2 = reference(2)
    exported = state_of(LlamaForCausalLM.from_pretrained(root / "model"))
    for k, v in after2.items():
        assert float((exported[k] - v).abs().max()) < 1e-5, f"from_pretrained {k}"
    plugin = HybridPlugin()
    booster = Booster(plugin)
    model = _llama()
    model, opt, *_ = booster.boost(model, _optimizer(model))
    booster.load_model(model, root / "model", opt)
    plugin.load_optimizer(opt, root / "optim")
    for k, v in state_of(model).items():
        assert torch.equal(v, exported[k]), f"loaded {k}"
    # save_state at tp2×pp2 → load_state in one process: the same model and optimizer state
    plugin2 = HybridPlugin()
    booster2 = Booster(plugin2)
    model2 = _llama()
    model2, opt2, *_ = booster2.boost(model2, _optimizer(model2))
    assert booster2.load_state(root / "state", model2, opt2)["step"] == 2
    for k, v in state_of(model2).items():
        assert torch.equal(v, exported[k]), f"load_state {k}"
    for (m1, _), (m2, _) in zip(opt.owned(), opt2.owned(), strict=True):
        for key, value in opt.optim.state[m1].items():
            assert torch.equal(value, opt2.optim.state[m2][key]), key
    booster.backward(lm_loss(model, _batches()[2]), opt)
    opt.clip_grad_by_norm(CLIP)
    opt.step()
    for k, v in reference(STEPS)[1].items():
        assert float((state_of(model)[k] - v).abs().max()) < 1e-5, f"resumed {k}"


def eight_rank_worker(rank: int, world: int) -> dict:
    plugin = HybridPlugin(tp_size=2, pp_size=2, zero_stage=1, sp_mode="split_gather", num_microbatches=2)
    return _train(plugin)


def test_dp2_tp2_pp2_on_eight_ranks_matches_one_process() -> None:
    _check(run_distributed(eight_rank_worker, 8, timeout_s=240)[0], False, "dp2×tp2×pp2")


def test_bad_pipeline_configs_raise_config_error() -> None:
    with pytest.raises(ConfigError, match=r"zero_stage=3.*pp_size=2"):
        HybridPlugin(pp_size=2, zero_stage=3)
    with pytest.raises(ConfigError, match="num_microbatches=2 is fewer than the pipeline stages pp_size=4"):
        HybridPlugin(pp_size=4, num_microbatches=2)
    with pytest.raises(ConfigError, match="3 layers cannot fill 4 pipeline stages"):
        stage_ranges([10, 10, 10], 4)
    with pytest.raises(ConfigError, match=r"layers_per_stage=\[1, 2\]"):
        stage_ranges([10, 10, 10, 10], 2, [1, 2])
    with pytest.raises(ConfigError, match="unknown pipeline schedule 'zigzag'"):
        HybridPlugin(pp_size=2, pp_schedule="zigzag")


def _odd_sequence(rank: int, world: int) -> str:
    """tp2×pp2 with Megatron-SP, a sequence of 7 tokens (tp 2 does not divide it)."""
    model = _llama()
    plugin = HybridPlugin(tp_size=2, pp_size=2, sp_mode="split_gather", num_microbatches=2)
    booster = Booster(plugin)
    model, opt, *_ = booster.boost(model, _optimizer(model))
    try:
        booster.execute_pipeline(iter([{"input_ids": torch.zeros(2, 7, dtype=torch.long)}]), model, None, opt)
    except ConfigError as exc:
        return str(exc)
    return ""


def test_indivisible_sequence_refused_on_every_pipeline_rank() -> None:
    """Every rank refuses the length before any stage communicates (not only the first stage's
    ranks, which would leave the others waiting on a send that never comes)."""
    messages = run_distributed(_odd_sequence, 4, timeout_s=60)
    assert all("sequence length 7 is not divisible by the sequence-parallel size 2" in m for m in messages), (
        messages
    )


def test_layers_balanced_by_parameter_count() -> None:
    # a heavy first layer: {4} | {1, 1, 1, 1} has the smallest largest stage (4)
    assert balance_layers([4, 1, 1, 1, 1], 2) == [1, 4]
    assert balance_layers([1, 1, 1, 1], 2) == [2, 2]
    assert balance_layers([5, 1, 1, 1, 1, 5], 3) == [1, 4, 1]
    assert [list(r) for r in stage_ranges([1] * 5, 2, [3, 2])] == [[0, 1, 2], [3, 4]]
