"""Optimizer state ↔ resharding pieces (see `megalith.checkpoint.optimizer_io`).

Tensor states whose size equals their master's (Adam's exp_avg / exp_avg_sq, SGD's momentum) are
split per parameter piece; scalar states (Adam's step) and hyper-parameters go to meta.json per
param group. The fp32 master values are saved as the state "master" so mixed-precision runs resume
exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from megalith.checkpoint import OptimPiece, PieceReader, write_meta, write_pieces
from megalith.checkpoint.optimizer_io import MASTER, SCALAR
from megalith.common.errors import CheckpointError
from megalith.optim import BoostedOptimizer


def save_optimizer_state(opt: BoostedOptimizer, directory: Path, rank: int) -> None:
    """Every rank calls this; replicated optimizers are written by rank 0 only."""
    if opt.replicated and rank != 0:
        return
    pieces: list[OptimPiece] = []
    for master, refs in opt.owned():
        state = opt.optim.state.get(master, {})
        flat = {k: v.view(-1) for k, v in state.items() if is_elementwise_state(v, master)}
        flat[MASTER] = master.view(-1)
        # per parameter, as "NAME::#KEY" (1 element): parameters of one group may differ (one that
        # started training later has a smaller Adam step)
        scalars = {f"{SCALAR}{k}": s for k, v in state.items() if (s := scalar_state(v)) is not None}
        for ref in refs:
            n = ref.end - ref.start
            tensors = {k: v[ref.offset : ref.offset + n] for k, v in flat.items()}
            own = {k: v.clone() for k, v in scalars.items()}  # safetensors refuses shared storage
            pieces.append(OptimPiece(ref.name, ref.start, ref.end, {**tensors, **own}))
    write_pieces(directory, rank, pieces)
    if rank == 0:
        write_meta(directory, _meta(opt))


def is_elementwise_state(value: Any, master: torch.Tensor) -> bool:
    """A state with one value per element (Adam's moments) — also of a 1-element parameter, whose
    moments are 1-D tensors of one element, unlike the 0-dim `step`."""
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() == master.numel()


def scalar_state(value: Any) -> torch.Tensor | None:
    """A 0-dim tensor or Python number state (Adam's step) as a 1-element tensor, else None."""
    if isinstance(value, torch.Tensor) and value.dim() == 0:
        return value.detach().reshape(1)
    if isinstance(value, bool | int | float):
        return torch.tensor([value], dtype=torch.float64)
    return None


def _meta(opt: BoostedOptimizer) -> dict[str, Any]:
    groups = []
    for group, names in zip(opt.param_groups, opt.group_param_names(), strict=True):
        hyper = {k: v for k, v in group.items() if k != "params" and is_json_hyper(v)}
        scalars: dict[str, float] = {}
        keys: set[str] = set()
        for m in group["params"]:
            for k, v in opt.optim.state.get(m, {}).items():
                if is_elementwise_state(v, m):
                    keys.add(k)
                elif (s := scalar_state(v)) is not None:
                    scalars[k] = float(s.item())  # legacy per-group value (the files hold each one's)
        groups.append({"hyper": hyper, "scalars": scalars, "tensor_keys": sorted(keys), "names": names})
    meta: dict[str, Any] = {"optimizer": type(opt.optim).__name__, "groups": groups}
    if opt.scaler is not None:
        meta["scaler"] = opt.scaler.state_dict()
    return meta


def is_json_hyper(v: Any) -> bool:
    """A param-group hyper-parameter that meta.json can hold (numbers, strings, tuples of numbers)."""
    if isinstance(v, tuple | list):
        return all(isinstance(x, int | float | bool) for x in v)
    return v is None or isinstance(v, int | float | bool | str)


def check_param_numels(numels: dict[str, int], saved: Callable[[str], int | None], directory: Path) -> None:
    """CheckpointError naming the first parameter (sorted by name) whose saved numel (`saved(name)`, None when not
    saved) differs from the model's (`numels`, e.g. `BoostedOptimizer.param_numels()`): a larger
    saved tensor would otherwise load its prefix. Runs before any state is read."""
    for name, numel in sorted(numels.items()):
        got = saved(name)
        if got is not None and got != numel:
            raise CheckpointError(
                f"optimizer checkpoint {directory} does not match the model: parameter {name!r} has "
                f"{got} elements in the checkpoint, {numel} in the model"
            )


def check_optimizer_meta(opt: BoostedOptimizer, meta: dict[str, Any], directory: Path) -> None:
    """The optimizer checkpoint's meta.json fits `opt`: same torch optimizer class, one entry with
    "hyper" per param group, and no parameter in another group than it was saved in (groups are
    matched by position; checkpoints without the "names" of each group skip that check)."""
    if meta.get("optimizer") != type(opt.optim).__name__:
        raise CheckpointError(
            f"optimizer checkpoint {directory} was written by {meta.get('optimizer')}, "
            f"not {type(opt.optim).__name__}"
        )
    groups = meta.get("groups")
    if not isinstance(groups, list) or not all(
        isinstance(g, dict) and isinstance(g.get("hyper"), dict) for g in groups
    ):
        raise CheckpointError(f"{directory / 'meta.json'}: 'groups' must be a list of objects with 'hyper'")
    if len(groups) != len(opt.param_groups):
        raise CheckpointError(
            f"optimizer checkpoint {directory} has {len(groups)} param groups, the optimizer has {len(opt.param_groups)}"
        )
    check_group_names(opt.group_param_names(), [g.get("names") for g in groups], directory)


def check_group_names(current: list[list[str]], saved: list[list[str] | None], directory: Path) -> None:
    """CheckpointError naming the first param group (by index) that holds a parameter the checkpoint
    saved in another group: the groups' hyper-parameters and states would go to the wrong ones."""
    saved_group: dict[str, int] = {}
    for j, names in enumerate(saved):
        for name in names or []:
            saved_group.setdefault(name, j)
    for i, names in enumerate(current):
        for name in names:
            j = saved_group.get(name, i)
            if j != i:
                raise CheckpointError(
                    f"optimizer checkpoint {directory}: param group {i} holds different parameters than "
                    f"when saved: {name!r} is in group {i} of the optimizer, group {j} of the checkpoint "
                    "(groups are matched by position; build them in the same order)"
                )


def check_optimizer_pieces(opt: BoostedOptimizer, reader: PieceReader, directory: Path) -> None:
    """Everything `load_optimizer_state` checks before it changes anything (metadata, parameters
    present, their sizes)."""
    check_optimizer_meta(opt, reader.meta, directory)
    missing = sorted({ref.name for _, refs in opt.owned() for ref in refs} - reader.names())
    if missing:
        raise CheckpointError(f"optimizer checkpoint {directory} has no state for parameter {missing[0]!r}")
    check_param_numels(opt.param_numels(), reader.numel, directory)


def load_optimizer_state(opt: BoostedOptimizer, directory: Path, reader: PieceReader | None = None) -> None:
    """Every rank calls this (it publishes the loaded masters into the model, a collective for ZeRO)."""
    reader = reader or PieceReader(directory)
    check_optimizer_pieces(opt, reader, directory)
    meta = reader.meta
    owned = {id(m): refs for m, refs in opt.owned()}
    for group, saved in zip(opt.param_groups, meta["groups"], strict=True):
        group.update({k: tuple(v) if isinstance(v, list) else v for k, v in saved["hyper"].items()})
        for master in group["params"]:
            _load_master_state(opt, master, owned[id(master)], saved, reader)
    opt.load_master_values(lambda name, s, e: reader.read(name, MASTER, s, e))
    if opt.scaler is not None and "scaler" in meta:
        opt.scaler.load_state_dict(meta["scaler"])


def _load_master_state(
    opt: BoostedOptimizer, master: torch.Tensor, refs: list, saved: dict, reader: PieceReader
) -> None:
    """State of one master from its parameters' pieces. Scalars ("#step") are per parameter in the
    files (the first parameter of the master that has one gives it); a tensor state saved for some
    of its parameters only starts at zero for the others. Checkpoints without per-parameter
    scalars (written by tensor-parallel plugins) take the group's from meta.json."""
    keys = set().union(*(reader.keys(ref.name) for ref in refs)) - {MASTER} if refs else set()
    per_param = any(k.startswith(SCALAR) for k in keys)
    tensor_keys = {k for k in keys if not k.startswith(SCALAR)}
    if not per_param:
        tensor_keys &= set(saved.get("tensor_keys") or ())
    if not tensor_keys and not per_param:
        opt.optim.state.pop(master, None)
        return
    state: dict[str, Any] = {}
    for key in sorted(tensor_keys):
        t = torch.zeros(master.numel(), dtype=master.dtype, device=master.device)
        for ref in refs:
            if key in reader.keys(ref.name):
                n = ref.end - ref.start
                t[ref.offset : ref.offset + n] = reader.read(ref.name, key, ref.start, ref.end)
        state[key] = t.view_as(master)
    if per_param:
        for key in sorted(k for k in keys if k.startswith(SCALAR)):
            name = next(r.name for r in refs if key in reader.keys(r.name))
            state[key[len(SCALAR) :]] = reader.read_scalar(name, key).reshape(())
    else:
        for key, value in (saved.get("scalars") or {}).items():
            state[key] = torch.tensor(value, dtype=torch.float32)
    opt.optim.state[master] = state
