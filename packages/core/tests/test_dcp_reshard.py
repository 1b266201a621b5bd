"""Sharded checkpoints reshard across plugins and world sizes (Core v2 §5, §6): save under
ZeRO-3 dp=4, ZeRO-2 dp=2 and DDP dp=2, load under each other; parameters and optimizer states are
identical; the HF export (gathered or streamed from the sharded checkpoint) loads with
from_pretrained; a missing shard file is a CheckpointError naming it."""

from __future__ import annotations

import shutil

import pytest
import torch

from megalith.booster import Booster
from megalith.booster.plugins import DDPPlugin, ZeroPlugin
from megalith.checkpoint import PieceReader, export_hf
from megalith.common.errors import CheckpointError
from megalith.testing import run_distributed, state_of
from megalith.testing.models import tiny_llama

SEQ = 12
SETUPS = {"zero3": 4, "zero2": 2, "ddp": 2}


def make(name: str, seed: int):
    plugin = {
        "zero3": lambda: ZeroPlugin(stage=3, bucket_size_mb=0.01),
        "zero2": lambda: ZeroPlugin(stage=2, bucket_size_mb=0.02),
        "ddp": DDPPlugin,
    }[name]()
    model = tiny_llama(seed)
    booster = Booster(plugin)
    model, opt, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1))
    return booster, model, opt


def full_params(booster, model) -> dict[str, torch.Tensor]:
    if isinstance(booster.plugin, ZeroPlugin) and booster.plugin.config.stage == 3:
        with booster.plugin.full_parameters(model):
            return state_of(model)
    return state_of(booster.unwrap(model))


def step(booster, model, opt, rank, world, seed):
    ids = torch.randint(0, 131, (8, SEQ), generator=torch.Generator().manual_seed(seed))
    part = ids[rank * 8 // world : (rank + 1) * 8 // world]
    booster.backward(model(input_ids=part, labels=part).loss, opt)
    opt.clip_grad_by_norm(1.0)
    opt.step()
    opt.zero_grad()


def saver(rank, world, name, path, hf_path):
    booster, model, opt = make(name, seed=0)
    for s in range(2):
        step(booster, model, opt, rank, world, s)
    booster.save_state(path, model, opt, step=2)
    if hf_path:
        booster.save_model(model, hf_path, max_shard_size_mb=0.02)
    return full_params(booster, model)


def loader(rank, world, name, path, resaved):
    booster, model, opt = make(name, seed=42)
    booster.load_state(path, model, opt)
    booster.save_optimizer(opt, resaved)
    return full_params(booster, model)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("saved")
    out = {}
    for name, world in SETUPS.items():
        hf = str(root / f"{name}_hf") if name == "zero3" else None
        out[name] = run_distributed(saver, world, name, str(root / name), hf)[0]
    return root, out


@pytest.mark.slow
@pytest.mark.parametrize("source", list(SETUPS))
def test_load_under_every_other_setup(saved, tmp_path, source):
    root, params = saved
    for target, world in SETUPS.items():
        if target == source:
            continue
        resaved = str(tmp_path / f"{source}_to_{target}")
        loaded = run_distributed(loader, world, target, str(root / source), resaved)[0]
        for k, v in params[source].items():
            assert torch.equal(loaded[k], v), (source, target, k)
        a, b = PieceReader(root / source / "optimizer"), PieceReader(tmp_path / f"{source}_to_{target}")
        assert a.names() == b.names()
        for name, p in params[source].items():
            for key in ("exp_avg", "exp_avg_sq", "master"):
                assert torch.equal(a.read(name, key, 0, p.numel()), b.read(name, key, 0, p.numel())), (
                    source,
                    target,
                    name,
                    key,
                )


def test_hf_exports_of_zero3_load_with_transformers(saved, tmp_path):
    from transformers import AutoModelForCausalLM

    root, params = saved
    streamed = export_hf(root / "zero3" / "model_sharded", tmp_path / "streamed", max_shard_bytes=20_000)
    assert (streamed / "model.safetensors.index.json").exists()  # several shards, written one by one
    for directory in (root / "zero3_hf", streamed):
        hf = state_of(AutoModelForCausalLM.from_pretrained(directory))
        assert hf.keys() == params["zero3"].keys()
        for k, v in hf.items():
            assert torch.equal(v, params["zero3"][k]), (directory, k)


def test_missing_shard_file_names_it(saved, tmp_path):
    root, _ = saved
    broken = tmp_path / "broken"
    shutil.copytree(root / "zero3", broken)
    (broken / "model_sharded" / "rank_00002.safetensors").unlink()
    booster, model, opt = make("ddp", seed=1)
    with pytest.raises(CheckpointError, match=r"missing shard file rank_00002\.safetensors"):
        booster.load_state(broken, model, opt)
