"""Sharded DCP checkpoints reshard across plugins and world sizes (Core v2 §5, §6): save under
ZeRO-3 dp=4, ZeRO-2 dp=2, DDP dp=2, FSDP2 dp=2 and one process; load under each other; parameters
and optimizer states (Adam moments, fp32 masters, step) are identical. ZeRO-2 and FSDP save
asynchronously and keep training right away: the checkpoint holds the values at the save. The HF
export streamed from the sharded checkpoint loads with from_pretrained; a missing shard file is
a CheckpointError naming it."""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import shutil
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megalith.booster import Booster
from megalith.booster.plugins import DDPPlugin, FSDPPlugin, ZeroPlugin
from megalith.checkpoint import DCPModelReader, DCPReader, FlatPiece, export_hf, save_pieces, split_for_rank
from megalith.common.errors import CheckpointError, ConfigError
from megalith.testing import run_distributed, state_of
from megalith.testing.models import tiny_llama

SEQ = 12
SETUPS = {"zero3": 4, "zero2": 2, "ddp": 2, "fsdp": 2, "single": 1}
ASYNC = {"zero2", "fsdp"}
MOMENTS = ("exp_avg", "exp_avg_sq")
LOADS = {  # target: the checkpoints it loads (ZeRO-3 dp=4 <-> ZeRO-2 dp=2 <-> DDP all pairs)
    "zero3": ["zero2", "ddp"],
    "zero2": ["zero3", "ddp", "fsdp"],
    "ddp": ["zero3", "zero2", "single"],
    "fsdp": ["zero3", "zero2"],
    "single": ["zero3", "zero2", "ddp", "fsdp"],
}
NUMELS = {n: p.numel() for n, p in tiny_llama().named_parameters()}


def make(name: str, seed: int):
    plugin = {
        "zero3": lambda: ZeroPlugin(stage=3, bucket_size_mb=0.01),
        "zero2": lambda: ZeroPlugin(stage=2, bucket_size_mb=0.02),
        "ddp": DDPPlugin,
        "fsdp": lambda: FSDPPlugin(group_size_mb=0.01),
        "single": DDPPlugin,
    }[name]()
    model = tiny_llama(seed)
    booster = Booster(plugin)
    model, opt, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1))
    return booster, model, opt


def snapshot(booster, model, opt) -> dict[str, torch.Tensor]:
    """Full parameters, and every parameter's full Adam state assembled from the pieces each rank
    owns (summed over ranks; replicated optimizers contribute from rank 0 only)."""
    full = {n: t.detach().float().clone() for n, t in booster.plugin.export_state(model) if n in NUMELS}
    rank = dist.get_rank() if dist.is_initialized() else 0
    keys = [(n, k) for n in NUMELS for k in (*MOMENTS, "master")]
    flat = {key: torch.zeros(NUMELS[key[0]]) for key in keys}
    steps = torch.zeros(len(NUMELS))
    index = {n: i for i, n in enumerate(NUMELS)}
    for master, refs in opt.owned():
        state = opt.optim.state.get(master, {})
        tensors = {"master": master, **{k: state[k] for k in MOMENTS if k in state}}
        for ref in refs:
            window = slice(ref.offset, ref.offset + ref.end - ref.start)
            if "step" in state:
                steps[index[ref.name]] = float(state["step"])
            if opt.replicated and rank != 0:
                continue
            for k, t in tensors.items():
                flat[(ref.name, k)][ref.start : ref.end] = t.detach().reshape(-1)[window].float()
    joined = torch.cat([flat[key] for key in keys])
    if dist.is_initialized():
        dist.all_reduce(joined)
        dist.all_reduce(steps, op=dist.ReduceOp.MAX)
    parts = joined.split([NUMELS[n] for n, _ in keys])
    out = {f"param::{n}": t for n, t in full.items()}
    # clones: a pickled view would carry its whole storage to the parent process
    out.update({f"{n}::{k}": t.clone() for (n, k), t in zip(keys, parts, strict=True)})
    out.update({f"{n}::step": steps[i : i + 1].clone() for n, i in index.items()})
    return out


def rank_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def step(booster, model, opt, seed):
    rank, world = rank_world()
    ids = torch.randint(0, 131, (8, SEQ), generator=torch.Generator().manual_seed(seed))
    part = ids[rank * 8 // world : (rank + 1) * 8 // world]
    booster.backward(model(input_ids=part, labels=part).loss, opt)
    opt.clip_grad_by_norm(1.0)
    opt.step()
    opt.zero_grad()


def save_one(name: str, root: str) -> dict[str, torch.Tensor]:
    booster, model, opt = make(name, seed=0)
    for s in range(2):
        step(booster, model, opt, s)
    before = snapshot(booster, model, opt)
    path = f"{root}/{name}"
    if name in ASYNC:
        handle = booster.save_state(path, model, opt, step=2, async_save=True)
        step(booster, model, opt, 2)  # params and states change while the write may still run
        booster.save_state(f"{path}_next", model, opt, step=3, async_save=True)  # waits for the first
        assert handle.done()
        assert booster.wait_for_checkpoint() == Path(f"{path}_next")
        assert booster.wait_for_checkpoint() is None
    else:
        booster.save_state(path, model, opt, step=2)
    if name == "zero3":
        booster.save_model(model, f"{root}/zero3_hf", max_shard_size_mb=0.02)  # gathered HF export
        booster.save_model(model, f"{root}/zero3_dcp", format="dcp")  # sharded, nothing gathered
    return before


def saver(rank, world, names, root):
    return {name: save_one(name, root) for name in names}


def loader(rank, world, plan, root):
    out = {}
    for target, sources in plan.items():
        for source in sources:
            booster, model, opt = make(target, seed=42)
            assert booster.load_state(f"{root}/{source}", model, opt)["step"] == 2
            out[(source, target)] = snapshot(booster, model, opt)
    return out


def in_child(fn, *args):
    """fn(0, 1, *args) in a forked process without a process group ("one process"), so this
    pytest process's heap stays as it was (later tests fork it and measure their memory)."""
    ctx = mp.get_context("fork")
    results = ctx.Queue()

    def target() -> None:
        torch.set_num_threads(1)  # the parent's intra-op thread pool does not survive the fork
        try:
            results.put(("ok", pickle.dumps(fn(0, 1, *args))))  # bytes: no shared-memory tensors
        except BaseException as exc:  # noqa: BLE001 - re-raised in the parent
            results.put(("err", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        results.close()
        results.join_thread()
        os._exit(0)

    child = ctx.Process(target=target)
    child.start()
    try:
        status, value = results.get(timeout=120)
    finally:
        child.join(timeout=30)
    if status != "ok":
        raise AssertionError(f"single-process run failed: {value}")
    return pickle.loads(value)


def by_world(fn, plan, root: str) -> dict:
    """One spawned run per world size (rank start-up dominates); world size 1 has no process group."""
    out = {}
    for world in sorted({SETUPS[name] for name in plan}, reverse=True):
        part = (
            {k: v for k, v in plan.items() if SETUPS[k] == world}
            if isinstance(plan, dict)
            else [k for k in plan if SETUPS[k] == world]
        )
        out.update(
            in_child(fn, part, root)
            if world == 1
            else run_distributed(fn, world, part, root, timeout_s=240)[0]
        )
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("saved")
    return root, by_world(saver, list(SETUPS), str(root))


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str) -> None:
    assert a.keys() == b.keys(), what
    for k, v in a.items():
        assert torch.equal(v, b[k]), (what, k)


@pytest.mark.slow
def test_load_under_other_plugins_and_world_sizes(saved):
    root, before = saved
    loaded = by_world(loader, LOADS, str(root))
    assert sorted(loaded) == sorted((s, t) for t, sources in LOADS.items() for s in sources)
    for (source, target), state in loaded.items():
        assert_same(state, before[source], f"{source} -> {target}")


def test_async_save_holds_the_values_at_the_save(saved):
    root, before = saved
    for name in ASYNC:
        assert not (root / f".{name}.tmp").exists() and not (root / f".{name}_next.tmp").exists()
        first = DCPModelReader(root / name / "model_sharded")
        later = DCPModelReader(root / f"{name}_next" / "model_sharded")
        for param in NUMELS:
            assert torch.equal(first.full(param).float(), before[name][f"param::{param}"]), (name, param)
        assert any(not torch.equal(first.full(p), later.full(p)) for p in NUMELS), name


def test_hf_exports_of_zero3_load_with_transformers(saved, tmp_path):
    from transformers import AutoModelForCausalLM

    root, before = saved
    streamed = export_hf(root / "zero3" / "model_sharded", tmp_path / "streamed", max_shard_bytes=20_000)
    assert (streamed / "model.safetensors.index.json").exists()  # several shards, written one by one
    from_dcp_model = export_hf(root / "zero3_dcp", tmp_path / "from_save_model")
    for directory in (root / "zero3_hf", streamed, from_dcp_model):
        hf = state_of(AutoModelForCausalLM.from_pretrained(directory))
        assert hf.keys() == NUMELS.keys()
        for k, v in hf.items():
            assert torch.equal(v, before["zero3"][f"param::{k}"]), (directory, k)
    booster, model, _ = make("single", seed=5)
    booster.load_model(model, root / "zero3_dcp")
    for k, v in state_of(model).items():
        assert torch.equal(v, before["zero3"][f"param::{k}"]), k
    with pytest.raises(ConfigError, match="format must be 'hf' or 'dcp', got 'npz'"):
        booster.save_model(model, tmp_path / "x", format="npz")


@pytest.mark.parametrize(
    ("part", "fname"), [("model_sharded", "__2_0.distcp"), ("optimizer", "__1_0.distcp")]
)
def test_missing_shard_file_names_it(saved, tmp_path, part, fname):
    root, _ = saved
    broken = tmp_path / "broken"
    shutil.copytree(root / "zero3", broken)
    (broken / part / fname).unlink()
    booster, model, opt = make("single", seed=1)
    with pytest.raises(CheckpointError, match=rf"missing shard file {fname}"):
        booster.load_state(broken, model, opt)


def test_reader_reads_any_range_across_chunks_and_rejects_bad_ranges(tmp_path):
    values = torch.arange(10, dtype=torch.float32)
    pieces = [
        FlatPiece("w", 0, 10, values[:3]),
        FlatPiece("w", 3, 10, values[3:7]),
        FlatPiece("b", 2, 5, values[:2]),
    ]
    save_pieces(tmp_path, pieces, {"note": "x"})  # one process: "b" covers [2, 4) of 5 elements only
    reader = DCPReader(tmp_path)
    assert reader.meta["note"] == "x" and reader.fqns() == {"w", "b"}
    assert torch.equal(reader.read("w", 2, 6), torch.tensor([2.0, 3.0, 4.0, 5.0]))  # spans two chunks
    assert torch.equal(reader.read("b", 2, 4), torch.tensor([0.0, 1.0]))
    with pytest.raises(CheckpointError, match=r"covers 3 of elements \[4, 10\) of 'w'"):
        reader.read("w", 4, 10)
    with pytest.raises(CheckpointError, match=r"range \[3, 11\) is outside tensor 'w' of 10 elements"):
        reader.read("w", 3, 11)
    with pytest.raises(CheckpointError, match="has no tensor 'nope'"):
        reader.read("nope", 0, 1)
    assert [(p.start, p.values.tolist()) for p in split_for_rank(pieces[:1], 1, 2)] == [(1, [1.0, 2.0])]


EXIT_WITHOUT_WAIT = """
import sys, time
import torch
import megalith.booster.checkpointing as ckpt
from megalith.booster import Booster
from megalith.booster.plugins import DDPPlugin

write = ckpt.SaveJob.write
ckpt.SaveJob.write = lambda self, group: (time.sleep(1.0), write(self, group))[1]  # a slow disk
booster = Booster(DDPPlugin())
torch.manual_seed(0)
model = torch.nn.Linear(8, 4)
model, opt, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
booster.save_state(sys.argv[1], model, opt, step=7, async_save=True)
print("RETURNED", flush=True)  # exits now, with the write still in flight
"""


def test_async_save_finishes_when_the_program_exits_without_waiting(tmp_path):
    import subprocess
    import sys

    path = tmp_path / "ckpt"
    proc = subprocess.run(
        [sys.executable, "-c", EXIT_WITHOUT_WAIT, str(path)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0 and "RETURNED" in proc.stdout, proc.stderr[-2000:]
    booster = Booster(DDPPlugin())
    model = torch.nn.Linear(8, 4)  # other values than the saved (seed 0) ones
    model, opt, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    assert booster.load_state(path, model, opt)["step"] == 7
    torch.manual_seed(0)
    assert torch.equal(model.weight, torch.nn.Linear(8, 4).weight)
