"""Exact resume, resharding across dp sizes and plugins, HF loadability, atomic saves (core v1 §5–6)."""

from __future__ import annotations

import os
import signal

import pytest
import torch
from torch.utils.data import TensorDataset

from megalith.booster import Booster
from megalith.booster.plugins import DDPPlugin, ZeroPlugin
from megalith.common.errors import CheckpointError
from megalith.testing import run_distributed, state_of
from megalith.testing.models import tiny_llama

SEQ, PER_RANK_BATCH = 12, 2


def dataset(n: int = 96) -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    return TensorDataset(torch.randint(0, 131, (n, SEQ), generator=g))


def setup(plugin, seed: int = 0):
    model = tiny_llama(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
    booster = Booster(plugin)
    loader = booster.prepare_dataloader(dataset(), batch_size=PER_RANK_BATCH, seed=3)
    model, opt, _, loader, sched = booster.boost(model, opt, dataloader=loader, lr_scheduler=sched)
    return booster, model, opt, loader, sched


def train(model, opt, sched, loader, booster, steps: int) -> list[float]:
    losses = []
    it = iter(loader)
    for _ in range(steps):
        (ids,) = next(it)
        labels = ids.clone()
        labels[torch.rand(labels.shape) < 0.2] = -100  # consumes the torch RNG: resume must restore it
        loss = model(input_ids=ids, labels=labels).loss
        booster.backward(loss, opt)
        opt.clip_grad_by_norm(1.0)
        opt.step()
        opt.zero_grad()
        sched.step()
        losses.append(loss.item())
    return losses


def straight(rank, world):
    torch.manual_seed(100 + rank)
    booster, model, opt, loader, sched = setup(ZeroPlugin(stage=2, bucket_size_mb=0.01))
    return train(model, opt, sched, loader, booster, 10)


def first_half(rank, world, path):
    torch.manual_seed(100 + rank)
    booster, model, opt, loader, sched = setup(ZeroPlugin(stage=2, bucket_size_mb=0.01))
    losses = train(model, opt, sched, loader, booster, 5)
    booster.save_state(path, model, opt, sched, loader, step=5)
    return losses


def second_half(rank, world, path):
    torch.manual_seed(999)  # deliberately different: the checkpoint must restore every RNG
    booster, model, opt, loader, sched = setup(ZeroPlugin(stage=2, bucket_size_mb=0.01), seed=5)
    meta = booster.load_state(path, model, opt, sched, loader)
    assert meta["step"] == 5
    return train(model, opt, sched, loader, booster, 5)


def test_exact_resume_is_bitwise(tmp_path):
    a = run_distributed(straight, 2)
    path = str(tmp_path / "ckpt")
    b1 = run_distributed(first_half, 2, path)
    b2 = run_distributed(second_half, 2, path)
    for rank in range(2):
        assert a[rank] == b1[rank] + b2[rank]  # bitwise: plain float equality
    assert a[0] != a[1]  # ranks saw different data


def save_dp4(rank, world, path):
    booster, model, opt, loader, sched = setup(ZeroPlugin(stage=2, bucket_size_mb=0.01))
    train(model, opt, sched, loader, booster, 2)
    booster.save_state(path, model, opt, sched, loader, step=2)
    saved = state_of(model)
    # One more step on a fixed batch (the same on every dp size: split over ranks).
    next_step(booster, model, opt, rank, world)
    return saved, state_of(model)


def next_step(booster, model, opt, rank, world):
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(0, 131, (8, SEQ), generator=g)
    part = ids[rank * 8 // world : (rank + 1) * 8 // world]
    booster.backward(model(input_ids=part, labels=part).loss, opt)
    opt.step()
    opt.zero_grad()


def load_elsewhere(rank, world, path, plugin_name):
    plugin = DDPPlugin() if plugin_name == "ddp" else ZeroPlugin(stage=2, bucket_size_mb=0.02)
    booster, model, opt, loader, sched = setup(plugin, seed=42)
    booster.load_state(path, model, opt, sched, loader)
    loaded = state_of(booster.unwrap(model))
    next_step(booster, model, opt, rank, world)
    return loaded, state_of(booster.unwrap(model))


@pytest.mark.parametrize(("world", "plugin_name"), [(2, "zero2"), (2, "ddp"), (1, "ddp")])
def test_zero2_dp4_checkpoint_reshards(tmp_path, world, plugin_name):
    path = str(tmp_path / "dp4")
    saved, after = run_distributed(save_dp4, 4, path)[0]
    loaded, after_here = run_distributed(load_elsewhere, world, path, plugin_name)[0]
    for k in saved:
        assert torch.equal(saved[k], loaded[k]), k
        # The optimizer state came along too: the next step agrees (sum order differs: 1e-6).
        assert torch.allclose(after[k], after_here[k], atol=1e-6, rtol=0), k


def test_model_dir_loads_with_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    booster, model, opt, loader, sched = setup(DDPPlugin())
    train(model, opt, sched, loader, booster, 2)
    out = booster.save_model(model, tmp_path / "hf", max_shard_size_mb=0.02)  # forces several shards
    assert (out / "model.safetensors.index.json").exists()
    hf = AutoModelForCausalLM.from_pretrained(out)
    mine, theirs = state_of(booster.unwrap(model)), state_of(hf)
    assert mine.keys() == theirs.keys()
    for k in mine:
        assert torch.equal(mine[k], theirs[k]), k


def test_tied_model_dir_loads_with_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    model = tiny_llama(tie=True)
    Booster(DDPPlugin()).save_model(model, tmp_path / "tied")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "tied")
    assert hf.lm_head.weight is hf.model.embed_tokens.weight
    assert torch.equal(hf.lm_head.weight, model.lm_head.weight)


def test_other_architecture_names_first_mismatched_key(tmp_path):
    booster = Booster(DDPPlugin())
    booster.save_model(tiny_llama(layers=2), tmp_path / "two")
    with pytest.raises(CheckpointError, match=r"model\.layers\.2\."):
        booster.load_model(tiny_llama(layers=3), tmp_path / "two")
    with pytest.raises(CheckpointError, match="shape mismatch for 'lm_head.weight'"):
        booster.load_model(tiny_llama(hidden=32, vocab_size=140), tmp_path / "two", strict=False)


def test_killed_save_leaves_previous_checkpoint(tmp_path):
    path = tmp_path / "ckpt"
    booster, model, opt, loader, sched = setup(DDPPlugin())
    train(model, opt, sched, loader, booster, 1)
    booster.save_state(path, model, opt, sched, loader, step=1)
    first = state_of(model)
    train(model, opt, sched, loader, booster, 1)

    pid = os.fork()
    if pid == 0:  # child: die with SIGKILL halfway through the save (after the model was written)
        import megalith.booster.booster as bb

        def die(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGKILL)

        bb.write_rng = die
        booster.save_state(path, model, opt, sched, loader, step=2)
        os._exit(3)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL

    booster2, model2, opt2, loader2, sched2 = setup(DDPPlugin(), seed=9)
    meta = booster2.load_state(path, model2, opt2, sched2, loader2)
    assert meta["step"] == 1
    for k, v in state_of(model2).items():
        assert torch.equal(v, first[k]), k
    # and the next save over the leftover staging directory works
    booster2.save_state(path, model2, opt2, sched2, loader2, step=3)
    assert booster2.load_state(path, model2, opt2, sched2, loader2)["step"] == 3


def test_missing_checkpoint_is_a_checkpoint_error(tmp_path):
    booster, model, opt, loader, sched = setup(DDPPlugin())
    with pytest.raises(CheckpointError, match="does not exist"):
        booster.load_state(tmp_path / "nope", model, opt, sched, loader)
