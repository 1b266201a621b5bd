"""Damaged checkpoint folders and rearranged optimizer param groups are refused before anything
changes: `load_state` raises a CheckpointError naming the file (never a bare FileNotFoundError,
UnpicklingError, JSONDecodeError or KeyError) and leaves the model's weights and the optimizer as
they were; a param group that holds other parameters than when saved is named with the first
parameter that moved (DCP `save_state` and the piece format of `save_optimizer`)."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from megalith.booster import Booster
from megalith.booster.plugins import DDPPlugin, FSDPPlugin, ZeroPlugin
from megalith.common.errors import CheckpointError
from megalith.testing import run_distributed


class Net(nn.Module):
    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.a = nn.Linear(5, 8)
        self.b = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def _groups(model: nn.Module, swapped: bool = False) -> list[dict]:
    a = {"params": list(model.a.parameters()), "lr": 0.1, "weight_decay": 0.0}
    b = {"params": list(model.b.parameters()), "lr": 0.001, "weight_decay": 0.5}
    return [b, a] if swapped else [a, b]


def _boosted(plugin=None, seed: int = 0, swapped: bool = False):
    booster = Booster(plugin or DDPPlugin())
    model = Net(seed)
    opt = torch.optim.AdamW(_groups(model, swapped))
    model, opt, *_ = booster.boost(model, opt)
    return booster, model, opt


def _train_and_save(root: Path, plugin=None) -> None:
    booster, model, opt = _boosted(plugin)
    booster.backward(model(torch.randn(4, 5, generator=torch.Generator().manual_seed(1))).pow(2).mean(), opt)
    opt.step()
    booster.save_state(root / "state", model, opt, step=1)
    booster.save_optimizer(opt, root / "pieces")
    torch.save(_snapshot(booster, model, opt)[0], root / "trained.pt")  # what a load must restore


def _snapshot(booster: Booster, model: nn.Module, opt) -> tuple[dict[str, torch.Tensor], list, int]:
    weights = {k: v.detach().clone() for k, v in booster.plugin.export_state(model)}
    hyper = [(g["lr"], g["weight_decay"]) for g in opt.param_groups]
    return weights, hyper, len(opt.state)


def _assert_untouched(before, after) -> None:
    assert before[0].keys() == after[0].keys()
    for name, value in before[0].items():
        assert torch.equal(after[0][name], value), f"{name} changed before the error"
    assert before[1:] == after[1:], "the optimizer changed before the error"


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ck")
    _train_and_save(root)
    return root


def _truncate(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def _rewrite_json(path: Path, edit: Callable[[dict], object]) -> None:
    data = json.loads(path.read_text())
    path.write_text(json.dumps(edit(data)))


def _drop(key: str) -> Callable[[dict], dict]:
    return lambda d: {k: v for k, v in d.items() if k != key}


def _trainer_without_dataloader(p: Path) -> None:
    torch.save({"lr_scheduler": None}, p / "trainer.pt")


def _groups_without_hyper(d: dict) -> dict:
    return {**d, "groups": [{"names": g["names"]} for g in d["groups"]]}


DAMAGE: dict[str, tuple[Callable[[Path], object], str]] = {
    # name: (damage the copied state dir, regex the message must match — it names the file)
    "missing trainer.pt": (lambda p: (p / "trainer.pt").unlink(), r"trainer\.pt: missing"),
    "truncated trainer.pt": (lambda p: _truncate(p / "trainer.pt"), r"trainer\.pt: cannot be read"),
    "trainer.pt without a key": (_trainer_without_dataloader, r"trainer\.pt: missing key 'dataloader'"),
    "truncated optimizer/.metadata": (
        lambda p: _truncate(p / "optimizer" / ".metadata"),
        r"optimizer/\.metadata: cannot be read \(UnpicklingError",
    ),
    "bad optimizer/meta.json": (
        lambda p: (p / "optimizer" / "meta.json").write_text("{"),
        r"optimizer/meta\.json: not valid JSON",
    ),
    "optimizer/meta.json groups without hyper": (
        lambda p: _rewrite_json(p / "optimizer" / "meta.json", _groups_without_hyper),
        r"optimizer/meta\.json: 'groups' must be",
    ),
    "missing optimizer/meta.json": (
        lambda p: (p / "optimizer" / "meta.json").unlink(),
        r"optimizer/meta\.json: missing",
    ),
    "truncated optimizer shard": (
        lambda p: _truncate(p / "optimizer" / "__0_0.distcp"),
        r"optimizer/__0_0\.distcp: truncated",
    ),
    "truncated model shard": (
        lambda p: _truncate(p / "model_sharded" / "__0_0.distcp"),
        r"model_sharded/__0_0\.distcp: truncated",
    ),
    "missing model_sharded/meta.json": (
        lambda p: (p / "model_sharded" / "meta.json").unlink(),
        r"model_sharded/meta\.json: missing",
    ),
    "missing optimizer dir": (lambda p: shutil.rmtree(p / "optimizer"), r"optimizer: missing"),
    "missing model dir": (lambda p: shutil.rmtree(p / "model_sharded"), r"model_sharded: missing"),
    "state.json without world_size": (
        lambda p: _rewrite_json(p / "state.json", _drop("world_size")),
        r"state\.json: missing key 'world_size'",
    ),
    "state.json without step": (
        lambda p: _rewrite_json(p / "state.json", _drop("step")),
        r"state\.json: missing key 'step'",
    ),
    "state.json world_size not an int": (
        lambda p: _rewrite_json(p / "state.json", lambda d: {**d, "world_size": "2"}),
        r"state\.json: world_size must be a positive integer, got '2'",
    ),
    "state.json not an object": (
        lambda p: (p / "state.json").write_text("[1]"),
        r"state\.json: expected a JSON object",
    ),
    "truncated rng": (
        lambda p: _truncate(p / "rng" / "rng_rank_00000.pt"),
        r"rng_rank_00000\.pt: cannot be read",
    ),
    "missing rng": (
        lambda p: (p / "rng" / "rng_rank_00000.pt").unlink(),
        r"rng_rank_00000\.pt: no RNG state",
    ),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_state_is_a_checkpoint_error_naming_the_file(
    saved: Path, tmp_path: Path, damage: str
) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(saved / "state", broken)
    mutate, message = DAMAGE[damage]
    mutate(broken)
    booster, model, opt = _boosted(seed=1)  # weights differ from the checkpoint's
    before = _snapshot(booster, model, opt)
    with pytest.raises(CheckpointError, match=message):
        booster.load_state(broken, model, opt)
    _assert_untouched(before, _snapshot(booster, model, opt))


def test_the_intact_checkpoint_loads(saved: Path) -> None:
    """The reference for the cases above: the same load of the undamaged copy succeeds."""
    booster, model, opt = _boosted(seed=1)
    assert booster.load_state(saved / "state", model, opt)["step"] == 1
    trained = torch.load(saved / "trained.pt")
    loaded = _snapshot(booster, model, opt)[0]
    assert loaded.keys() == trained.keys()
    for name, value in trained.items():
        assert torch.equal(loaded[name], value), f"{name} was not restored"


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda p: (p / "meta.json").write_text("{"), r"pieces/meta\.json: not valid JSON"),
        (lambda p: _truncate(p / "rank_00000.safetensors"), r"rank_00000\.safetensors: cannot be read"),
        (lambda p: (p / "meta.json").unlink(), r"pieces/meta\.json: missing"),
    ],
)
def test_damaged_optimizer_pieces_name_the_file(saved: Path, tmp_path: Path, damage, message: str) -> None:
    broken = tmp_path / "pieces"
    shutil.copytree(saved / "pieces", broken)
    damage(broken)
    booster, model, opt = _boosted(seed=1)
    before = _snapshot(booster, model, opt)
    with pytest.raises(CheckpointError, match=message):
        booster.load_optimizer(opt, broken)
    _assert_untouched(before, _snapshot(booster, model, opt))


def test_truncated_dcp_metadata_in_load_model_names_the_file(saved: Path, tmp_path: Path) -> None:
    broken = tmp_path / "model"
    shutil.copytree(saved / "state" / "model_sharded", broken)
    _truncate(broken / ".metadata")
    booster, model, opt = _boosted(seed=1)
    before = _snapshot(booster, model, opt)
    with pytest.raises(CheckpointError, match=r"model/\.metadata: cannot be read"):
        booster.load_model(model, broken)
    _assert_untouched(before, _snapshot(booster, model, opt))


# -- ranks agree: a file only one rank reads fails every rank, none waits in a collective ------------------
def one_rank_damaged_worker(rank: int, world: int, root: str) -> str:
    path = Path(root)
    _train_and_save(path, ZeroPlugin(stage=2, bucket_size_mb=0.001))
    if rank == 0:
        _truncate(path / "state" / "rng" / "rng_rank_00001.pt")  # read by rank 1 only
    torch.distributed.barrier()
    booster, model, opt = _boosted(ZeroPlugin(stage=2, bucket_size_mb=0.001), seed=1)
    before = _snapshot(booster, model, opt)
    try:
        booster.load_state(path / "state", model, opt)
    except CheckpointError as exc:
        _assert_untouched(before, _snapshot(booster, model, opt))
        return str(exc)
    return "NO ERROR"


def test_a_file_only_one_rank_reads_fails_every_rank(tmp_path: Path) -> None:
    messages = run_distributed(one_rank_damaged_worker, 2, str(tmp_path), timeout_s=120)
    for rank, message in enumerate(messages):
        assert "rng_rank_00001.pt: cannot be read" in message, f"rank {rank}: {message}"
    assert messages[0].startswith("rank 1: "), messages[0]


# -- param groups: matched by position, so the parameters of each are recorded and compared -------------
def _group_names(meta_json: Path) -> list[list[str]]:
    return [g["names"] for g in json.loads(meta_json.read_text())["groups"]]


EXPECTED_NAMES = [["a.bias", "a.weight"], ["b.bias", "b.weight"]]
SWAP_MESSAGE = r"param group 0 holds different parameters .*'b\.bias' is in group 0 of the optimizer, group 1"


def test_swapped_param_groups_are_refused(saved: Path) -> None:
    assert _group_names(saved / "state" / "optimizer" / "meta.json") == EXPECTED_NAMES
    assert _group_names(saved / "pieces" / "meta.json") == EXPECTED_NAMES
    booster, model, opt = _boosted(seed=1, swapped=True)
    before = _snapshot(booster, model, opt)
    for load in (
        lambda: booster.load_state(saved / "state", model, opt),
        lambda: booster.load_optimizer(opt, saved / "state" / "optimizer"),
        lambda: booster.load_optimizer(opt, saved / "pieces"),
    ):
        with pytest.raises(CheckpointError, match=SWAP_MESSAGE):
            load()
    _assert_untouched(before, _snapshot(booster, model, opt))


def test_checkpoints_without_group_names_still_load(saved: Path, tmp_path: Path) -> None:
    old = tmp_path / "old"
    shutil.copytree(saved, old)
    for meta in (old / "state" / "optimizer" / "meta.json", old / "pieces" / "meta.json"):
        _rewrite_json(meta, lambda d: {**d, "groups": [_drop("names")(g) for g in d["groups"]]})
    for load in ("state", "pieces"):
        booster, model, opt = _boosted(seed=1)
        if load == "state":
            booster.load_state(old / "state", model, opt)
        else:
            booster.load_optimizer(opt, old / "pieces")
        assert [(g["lr"], g["weight_decay"]) for g in opt.param_groups] == [(0.1, 0.0), (0.001, 0.5)]
        assert len(opt.state) == 4


SHARDED = {
    "zero2": lambda: ZeroPlugin(stage=2, bucket_size_mb=0.001),
    "zero3": lambda: ZeroPlugin(stage=3, bucket_size_mb=0.001),
    "fsdp": FSDPPlugin,
}


def sharded_groups_worker(rank: int, world: int, plugin_name: str, root: str) -> tuple[list, list, list]:
    """Each rank owns part of the parameters: the recorded names must still be every parameter."""
    path = Path(root)
    _train_and_save(path, SHARDED[plugin_name]())
    booster, model, opt = _boosted(SHARDED[plugin_name](), seed=1, swapped=True)
    errors = []
    for load in (
        lambda: booster.load_state(path / "state", model, opt),
        lambda: booster.load_optimizer(opt, path / "pieces"),
    ):
        try:
            load()
            errors.append("NO ERROR")
        except CheckpointError as exc:
            errors.append(str(exc))
    return (
        _group_names(path / "state" / "optimizer" / "meta.json"),
        _group_names(path / "pieces" / "meta.json"),
        errors,
    )


@pytest.mark.parametrize("plugin_name", list(SHARDED))
def test_sharded_plugins_record_every_parameter_of_each_group(tmp_path: Path, plugin_name: str) -> None:
    results = run_distributed(sharded_groups_worker, 2, plugin_name, str(tmp_path), timeout_s=180)
    for rank, (dcp_names, piece_names, errors) in enumerate(results):
        assert dcp_names == EXPECTED_NAMES, f"{plugin_name} rank {rank}"
        assert piece_names == EXPECTED_NAMES, f"{plugin_name} rank {rank}"
        for message in errors:
            assert "param group 0 holds different parameters" in message, (
                f"{plugin_name} rank {rank}: {message}"
            )
            assert "'b.bias'" in message, f"{plugin_name} rank {rank}: {message}"
