"""Checkpoints that do not fit the model are refused before anything is read: every load path
(load_state, load_model of DCP / HF / sharded dirs, load_optimizer of both formats) under DDP, one
process, ZeRO-1/2/3 and FSDP2 raises a CheckpointError naming the first mismatched key and leaves
the model as it was."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from megalith.booster import Booster
from megalith.booster.plugins import DDPPlugin, FSDPPlugin, ZeroPlugin
from megalith.checkpoint import atomic
from megalith.common.errors import CheckpointError
from megalith.testing import run_distributed

PLUGINS = {
    "ddp": DDPPlugin,
    "zero1": lambda: ZeroPlugin(stage=1),
    "zero2": lambda: ZeroPlugin(stage=2),
    "zero3": lambda: ZeroPlugin(stage=3),
    "fsdp": FSDPPlugin,
}


class Net(nn.Module):
    def __init__(self, hidden: int = 8, inputs: int = 5) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(inputs, hidden)
        self.b = nn.Linear(hidden, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def _boosted(plugin_name: str, model: nn.Module):
    booster = Booster(PLUGINS[plugin_name]())
    model, opt, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    return booster, model, opt


def _values(booster: Booster, model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in booster.plugin.export_state(model)}


def _save_all(plugin_name: str, root: Path) -> None:
    booster, model, opt = _boosted(plugin_name, Net(8))
    booster.backward(model(torch.randn(4, 5)).pow(2).mean(), opt)
    opt.step()
    booster.save_state(root / "state", model, opt, step=1)
    booster.save_model(model, root / "model_dcp", format="dcp")
    booster.save_model(model, root / "model_hf")
    booster.save_optimizer(opt, root / "optim_pieces")


def _load_errors(plugin_name: str, root: Path, model: nn.Module) -> tuple[dict[str, str], bool]:
    """The message of every load path into `model` (a different architecture), and whether the
    model's values survived all of them untouched."""
    booster, model, opt = _boosted(plugin_name, model)
    before = _values(booster, model)
    loads = {
        "load_state": lambda: booster.load_state(root / "state", model, opt),
        "load_model_dcp": lambda: booster.load_model(model, root / "model_dcp", opt),
        "load_model_hf": lambda: booster.load_model(model, root / "model_hf", opt),
        "load_optimizer_dcp": lambda: booster.load_optimizer(opt, root / "state" / "optimizer"),
        "load_optimizer_pieces": lambda: booster.load_optimizer(opt, root / "optim_pieces"),
    }
    errors = {}
    for what, load in loads.items():
        try:
            load()
            errors[what] = "NO ERROR"
        except CheckpointError as exc:
            errors[what] = str(exc)
    after = _values(booster, model)
    return errors, all(torch.equal(after[k], v) for k, v in before.items())


def mismatch_worker(rank: int, world: int, plugin_name: str, root: str) -> tuple[dict[str, str], bool]:
    if rank == 0:
        Path(root).mkdir(parents=True, exist_ok=True)
    _save_all(plugin_name, Path(root))
    return _load_errors(plugin_name, Path(root), Net(6))


def _assert_names_a_bias(errors: dict[str, str], unchanged: bool, what: str) -> None:
    for path, message in errors.items():
        # the first mismatched key by name: a.bias, saved with 8 elements, 6 in the model
        assert "'a.bias'" in message, f"{what} {path}: {message}"
        assert "(8,)" in message or "8 elements" in message, f"{what} {path}: {message}"
    assert unchanged, f"{what}: the model changed before the error"


@pytest.mark.parametrize("plugin_name", ["zero2", "zero3", "fsdp"])
def test_mismatched_shapes_are_refused_on_every_load_path(tmp_path: Path, plugin_name: str) -> None:
    results = run_distributed(mismatch_worker, 2, plugin_name, str(tmp_path), timeout_s=240)
    for rank, (errors, unchanged) in enumerate(results):
        _assert_names_a_bias(errors, unchanged, f"{plugin_name} rank {rank}")


def test_mismatched_shapes_are_refused_in_one_process(tmp_path: Path) -> None:
    _save_all("ddp", tmp_path)
    errors, unchanged = _load_errors("ddp", tmp_path, Net(6))
    _assert_names_a_bias(errors, unchanged, "one process")


def test_same_numel_reshape_is_refused(tmp_path: Path) -> None:
    """[8, 5] → [5, 8] has the same numel: only the shape check can see it."""

    class Transposed(Net):
        def __init__(self) -> None:
            super().__init__(8)
            self.a = nn.Linear(8, 5)  # a.weight [5, 8] (40 elements, as the saved [8, 5])
            self.a.bias = nn.Parameter(torch.zeros(8))  # as saved: a.weight is the only mismatch
            self.b = nn.Linear(8, 3)

    _save_all("ddp", tmp_path)
    booster, model, opt = _boosted("ddp", Transposed())
    before = _values(booster, model)
    for load in (
        lambda: booster.load_state(tmp_path / "state", model, opt),
        lambda: booster.load_model(model, tmp_path / "model_dcp", opt),
        lambda: booster.load_model(model, tmp_path / "model_hf", opt),
    ):
        with pytest.raises(CheckpointError, match=r"'a\.weight'.*\(5, 8\).*\(8, 5\)"):
            load()
    after = _values(booster, model)
    assert all(torch.equal(after[k], v) for k, v in before.items())


# -- per-parameter optimizer scalars and 1-element parameters (save_optimizer / load_optimizer) ------
class LateNet(nn.Module):
    """`late` joins training at the third step (a smaller Adam step); `scale` has one element."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(5, 4)
        self.late = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor, use_late: bool) -> torch.Tensor:
        h = torch.tanh(self.a(x)) * self.scale
        return self.late(h) if use_late else h


def _late_run(steps: range, booster: Booster, model: nn.Module, opt) -> None:
    for i in steps:
        x = torch.randn(3, 5, generator=torch.Generator().manual_seed(i))
        booster.backward(model(x, use_late=i >= 2).pow(2).mean(), opt)
        opt.step()
        opt.zero_grad()


def test_optimizer_pieces_keep_per_parameter_step_and_one_element_states(tmp_path: Path) -> None:
    straight = _boosted("ddp", LateNet())
    _late_run(range(6), *straight)
    first = _boosted("ddp", LateNet())
    _late_run(range(3), *first)
    first[0].save_optimizer(first[2], tmp_path / "opt")
    first[0].save_model(first[1], tmp_path / "model")
    booster, model, opt = _boosted("ddp", LateNet())
    booster.load_model(model, tmp_path / "model", opt)
    booster.load_optimizer(opt, tmp_path / "opt")
    steps = {n: float(opt.state[p]["step"]) for n, p in model.named_parameters()}
    assert steps == {"a.weight": 3.0, "a.bias": 3.0, "late.weight": 1.0, "late.bias": 1.0, "scale": 3.0}
    assert opt.state[model.scale]["exp_avg"].shape == (1,)
    _late_run(range(3, 6), booster, model, opt)
    for name, value in straight[1].state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name


# -- load_model without the optimizer under mixed precision --------------------------------------------
def test_load_model_without_optimizer_refreshes_the_masters(tmp_path: Path) -> None:
    pretrained = Net(8)
    Booster(DDPPlugin()).save_model(pretrained, tmp_path / "pretrained")
    booster = Booster(DDPPlugin(), precision="bf16")
    model = Net(8)
    with torch.no_grad():
        model.a.weight.add_(1.0)  # differs from the checkpoint
    model, opt, *_ = booster.boost(model, torch.optim.SGD(model.parameters(), lr=0.0))
    booster.load_model(model, tmp_path / "pretrained")  # the optimizer is not passed
    booster.backward(model(torch.randn(2, 5).bfloat16()).float().sum(), opt)
    opt.step()  # lr 0: copies the masters back into the model
    assert torch.equal(model.a.weight, pretrained.a.weight.bfloat16())


# -- atomic commit ------------------------------------------------------------------------------------------
def test_two_crashes_in_commit_leave_a_loadable_checkpoint(tmp_path: Path, monkeypatch) -> None:
    """Crash 1 between the two renames leaves only `.ck.old`; crash 2, in the next commit before
    its staging directory is renamed, must not have deleted it."""
    from megalith.checkpoint import atomic, commit, fresh_staging, resolve

    ck = tmp_path / "ck"
    fresh_staging(ck).joinpath("v").write_text("1")
    commit(ck)
    real = atomic.os.rename
    calls = []

    def crash_on(n: int):
        def rename(src, dst):
            calls.append(src)
            if len(calls) == n:
                raise KeyboardInterrupt("simulated crash")
            real(src, dst)

        return rename

    fresh_staging(ck).joinpath("v").write_text("2")
    monkeypatch.setattr(atomic.os, "rename", crash_on(2))
    with pytest.raises(KeyboardInterrupt):
        commit(ck)
    assert (resolve(ck) / "v").read_text() == "1"
    calls.clear()
    fresh_staging(ck).joinpath("v").write_text("3")
    monkeypatch.setattr(atomic.os, "rename", crash_on(1))
    with pytest.raises(KeyboardInterrupt):
        commit(ck)
    assert (resolve(ck) / "v").read_text() == "1"
    monkeypatch.setattr(atomic.os, "rename", real)
    fresh_staging(ck).joinpath("v").write_text("4")
    commit(ck)
    assert (resolve(ck) / "v").read_text() == "4"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


def test_write_text_replaces_the_file_or_leaves_it(tmp_path, monkeypatch):
    """`atomic.write_text`: the new content in place and no temporary file; if the rename fails,
    the old content stays and the temporary file is gone."""
    path = tmp_path / "sub" / "eval.json"
    atomic.write_text(path, "old\n")
    atomic.write_text(path, "new\n")
    assert path.read_text() == "new\n"
    assert [p.name for p in path.parent.iterdir()] == ["eval.json"]

    def fail(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(atomic.os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        atomic.write_text(path, "newer\n")
    assert path.read_text() == "new\n"
    assert [p.name for p in path.parent.iterdir()] == ["eval.json"]


def test_hybrid_plugin_refuses_an_optimizer_checkpoint_of_other_sizes(tmp_path: Path) -> None:
    """HybridPlugin reads both optimizer formats through its own reader (full parameters sliced into
    tp blocks): a DCP one (save_state's) and a piece one of another model are refused by name
    before anything changes."""
    from megalith.booster.plugins import HybridPlugin
    from megalith.tensor_parallel import TensorParallelPlan

    _save_all("ddp", tmp_path)
    booster, net = Booster(HybridPlugin(tp_size=1, policy=TensorParallelPlan(layers={}))), Net(6)
    model, opt, *_ = booster.boost(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    before = _values(booster, model)
    errors = {}
    for what, directory in (("dcp", tmp_path / "state" / "optimizer"), ("pieces", tmp_path / "optim_pieces")):
        with pytest.raises(CheckpointError) as caught:
            booster.load_optimizer(opt, directory)
        errors[what] = str(caught.value)
    after = _values(booster, model)
    _assert_names_a_bias(errors, all(torch.equal(after[k], v) for k, v in before.items()), "hybrid")
