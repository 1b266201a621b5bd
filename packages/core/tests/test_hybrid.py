"""HybridPlugin on a 2-D mesh (tp=2 × dp=2, 4 gloo ranks): equivalence with one process for ZeRO-2,
ZeRO-1 and all-reduce data parallelism with each sequence-parallel mode and global-norm clipping;
checkpoints that move between tp2×dp2, tp1×dp4 (ZeRO) and DDP in both directions; HF export."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from megalith.booster import Booster, plan
from megalith.booster.plugins import DDPPlugin, HybridPlugin, ZeroPlugin
from megalith.common.errors import ConfigError
from megalith.tensor_parallel import full_state_dict
from megalith.testing import run_distributed, state_of
from megalith.testing.models import lm_loss, synthetic_batches, tiny_llama

STEPS, GLOBAL_BATCH, SEQ, LR, CLIP = 3, 8, 12, 1e-3, 0.05
VARIANTS = {
    "zero2_split_gather": (2, "split_gather"),
    "zero1_none": (1, "none"),
    "ddp_all_to_all": (0, "all_to_all"),
}


def _optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1, eps=1e-6)


@cache
def reference(steps: int) -> dict[str, torch.Tensor]:
    """One process, plain torch, the whole global batch, clipped to CLIP."""
    model = tiny_llama()
    opt = _optimizer(model)
    for ids in synthetic_batches(STEPS, GLOBAL_BATCH, SEQ)[:steps]:
        lm_loss(model, ids).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
    return state_of(model)


def _steps(booster: Booster, model, opt, plugin, steps: range) -> None:
    per = GLOBAL_BATCH // plugin.dp_size()
    lo = plugin.dp_rank() * per
    for step in steps:
        ids = synthetic_batches(STEPS, GLOBAL_BATCH, SEQ)[step][lo : lo + per]
        booster.backward(lm_loss(model, ids), opt)
        opt.clip_grad_by_norm(CLIP)
        opt.step()
        opt.zero_grad()


def _full(model, plugin) -> dict[str, torch.Tensor]:
    group = plugin.tp_group if isinstance(plugin, HybridPlugin) else None
    return {k: v.clone() for k, v in full_state_dict(model, group).items()}


def _boost(plugin):
    booster = Booster(plugin)
    model = tiny_llama()
    model, opt, *_ = booster.boost(model, _optimizer(model))
    return booster, model, opt


def equivalence_worker(rank: int, world: int) -> dict[str, dict[str, torch.Tensor]]:
    out = {}
    for name, (stage, mode) in VARIANTS.items():
        plugin = HybridPlugin(tp_size=2, sp_mode=mode, zero_stage=stage)
        assert plugin.dp_size() == 2  # known before boost (prepare_dataloader may come first)
        booster, model, opt = _boost(plugin)
        _steps(booster, model, opt, plugin, range(STEPS))
        out[name] = _full(model, plugin)
    # bf16 compute with fp32 masters initialised from the exact fp32 blocks.
    plugin = HybridPlugin(tp_size=2, sp_mode="split_gather", zero_stage=2)
    booster = Booster(plugin, precision="bf16")
    model = tiny_llama()
    model, opt, *_ = booster.boost(model, _optimizer(model))
    _steps(booster, model, opt, plugin, range(1))
    out["bf16"] = {"masters_fp32": torch.tensor(all(m.dtype == torch.float32 for m in opt.masters))}
    out["bf16"]["finite"] = torch.tensor(all(torch.isfinite(p).all() for p in model.parameters()))
    return out


def _assert_matches(state: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], what: str) -> None:
    for name, value in ref.items():
        diff = float((state[name] - value).abs().max())
        assert diff < 1e-5, f"{what} {name}: max |diff| {diff:.2e}"


def test_hybrid_tp2_dp2_matches_single_process() -> None:
    results = run_distributed(equivalence_worker, 4, timeout_s=240)
    for name in VARIANTS:
        for rank, states in enumerate(results):
            _assert_matches(states[name], reference(STEPS), f"{name} rank {rank}")
    assert all(bool(r["bf16"]["masters_fp32"]) and bool(r["bf16"]["finite"]) for r in results)
    assert not torch.equal(reference(STEPS)["lm_head.weight"], tiny_llama().lm_head.weight)


# -- checkpoints: tp2×dp2 → tp1×dp4 / DDP → tp2×dp2 ------------------------------------------------
def save_tp2(rank: int, world: int, root: str) -> dict[str, torch.Tensor]:
    plugin = HybridPlugin(tp_size=2, sp_mode="split_gather", zero_stage=2)
    booster, model, opt = _boost(plugin)
    _steps(booster, model, opt, plugin, range(2))
    booster.save_model(model, Path(root) / "tp2_model")  # the plugin's export_state gathers the blocks
    # The booster hands tensor-parallel optimizer state to the plugin's writer (full-parameter pieces).
    booster.save_optimizer(opt, Path(root) / "tp2_optim")
    _steps(booster, model, opt, plugin, range(2, 3))
    return _full(model, plugin)


def load_dp4(rank: int, world: int, root: str) -> dict[str, dict[str, torch.Tensor]]:
    out = {}
    for name, plugin in (("zero_dp4", ZeroPlugin(stage=2)), ("ddp", DDPPlugin())):
        booster, model, opt = _boost(plugin)
        booster.load_model(model, Path(root) / "tp2_model", opt)
        booster.load_optimizer(opt, Path(root) / "tp2_optim")
        out[f"{name}_loaded"] = state_of(booster.unwrap(model))
        if name == "zero_dp4":
            booster.save_model(model, Path(root) / "dp4_model")
            booster.save_optimizer(opt, Path(root) / "dp4_optim")
            booster.save_state(Path(root) / "dp4_state", model, opt, step=2)  # DCP model + optimizer
        _steps(booster, model, opt, plugin, range(2, 3))
        out[name] = state_of(booster.unwrap(model))
    return out


def load_tp2(rank: int, world: int, root: str) -> dict[str, dict[str, torch.Tensor]]:
    out = {}
    for source in ("pieces", "dcp"):
        plugin = HybridPlugin(tp_size=2, zero_stage=1)
        booster, model, opt = _boost(plugin)
        if source == "pieces":
            booster.load_model(model, Path(root) / "dp4_model", opt)  # each rank slices its blocks
            plugin.load_optimizer(opt, Path(root) / "dp4_optim")
        else:  # ZeRO's sharded save_state: full-parameter ranges, sliced into tp blocks on load
            assert booster.load_state(Path(root) / "dp4_state", model, opt)["step"] == 2
        _steps(booster, model, opt, plugin, range(2, 3))
        out[source] = _full(model, plugin)
    return out


def test_checkpoint_moves_between_tp2_dp2_dp4_and_ddp(tmp_path: Path) -> None:
    after2, after3 = reference(2), reference(STEPS)
    for state in run_distributed(save_tp2, 4, str(tmp_path), timeout_s=180):
        _assert_matches(state, after3, "tp2×dp2 continued")
    # The HF export is an ordinary HF checkpoint of the full (unpadded) tensors.
    exported = LlamaForCausalLM.from_pretrained(tmp_path / "tp2_model")
    _assert_matches(state_of(exported), after2, "from_pretrained")
    for states in run_distributed(load_dp4, 4, str(tmp_path), timeout_s=180):
        for name in ("zero_dp4", "ddp"):
            _assert_matches(states[f"{name}_loaded"], after2, f"{name} loaded")
            _assert_matches(states[name], after3, f"{name} after a step")  # optimizer state came along
    for states in run_distributed(load_tp2, 4, str(tmp_path), timeout_s=180):
        _assert_matches(states["pieces"], after3, "tp1×dp4 → tp2×dp2")
        _assert_matches(states["dcp"], after3, "tp1×dp4 save_state (DCP) → tp2×dp2")


# -- accumulation over several synchronised backwards ------------------------------------------------
def accum_reference() -> dict[str, torch.Tensor]:
    """One process: 2 steps, each of 2 micro-batches of loss/2."""
    model = tiny_llama()
    opt = _optimizer(model)
    batches = synthetic_batches(4, GLOBAL_BATCH, SEQ)
    for step in range(2):
        for ids in batches[2 * step : 2 * step + 2]:
            (lm_loss(model, ids) / 2).backward()
        opt.step()
        opt.zero_grad()
    return state_of(model)


def sync_accum_worker(rank: int, world: int) -> dict[str, dict[str, torch.Tensor]]:
    """tp=2 split_gather: both micro-batches reduced (no `no_sync`), so the tp sum of the norm
    weights' sequence-partial gradients runs twice per step."""
    batches, out = synthetic_batches(4, GLOBAL_BATCH, SEQ), {}
    for stage in (0, 1, 2):
        plugin = HybridPlugin(tp_size=2, sp_mode="split_gather", zero_stage=stage)
        booster, model, opt = _boost(plugin)
        for step in range(2):
            for ids in batches[2 * step : 2 * step + 2]:
                booster.backward(lm_loss(model, ids) / 2, opt)
            opt.step()
            opt.zero_grad()
        out[f"zero{stage}"] = _full(model, plugin)
    return out


def test_split_gather_accumulates_over_synchronised_backwards() -> None:
    ref = accum_reference()
    for rank, states in enumerate(run_distributed(sync_accum_worker, 2, timeout_s=240)):
        for name, state in states.items():
            _assert_matches(state, ref, f"{name} rank {rank}")


# -- configuration -----------------------------------------------------------------------------------
def test_hybrid_config_rejects_bad_values() -> None:
    with pytest.raises(ConfigError, match="'ring'"):
        HybridPlugin(tp_size=2, sp_mode="ring")
    with pytest.raises(ConfigError, match="zero_stage must be 0, 1 or 2, got 3"):
        HybridPlugin(zero_stage=3)
    with pytest.raises(ConfigError, match="world_size=6 is not divisible by tp"):
        plan(tiny_llama(), HybridPlugin(tp_size=4), world_size=6)


def test_memory_plan_divides_by_tp_and_dp() -> None:
    model = tiny_llama()
    mem = plan(model, HybridPlugin(tp_size=2, zero_stage=2), world_size=8)
    # One tp rank of the tiny Llama (h=32, I=70, 4 heads of 8, 2 KV heads, V=131 padded to 132):
    # embedding and head 66 rows each; per layer q 16x32, k and v 8x32, o 32x16, gate and up 35x32,
    # down 32x35, two replicated norms of 32; the final norm 32 (replicated, full size).
    layer = 16 * 32 + 2 * 8 * 32 + 32 * 16 + 2 * 35 * 32 + 32 * 35 + 2 * 32
    local = 2 * 66 * 32 + 2 * layer + 32
    assert mem.params == 4 * local  # fp32 weights of one tp rank
    assert mem.optimizer_states == 8 * local // 4  # Adam states of the tp shard over dp=4
