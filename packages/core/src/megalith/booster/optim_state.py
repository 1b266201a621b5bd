"""Optimizer state ↔ resharding pieces (see `megalith.checkpoint.optimizer_io`).

Tensor states whose size equals their master's (Adam's exp_avg / exp_avg_sq, SGD's momentum) are
split per parameter piece; scalar states (Adam's step) and hyper-parameters go to meta.json per
param group. The fp32 master values are saved as the state "master" so mixed-precision runs resume
exactly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from megalith.checkpoint import OptimPiece, PieceReader, write_meta, write_pieces
from megalith.checkpoint.optimizer_io import MASTER
from megalith.common.errors import CheckpointError
from megalith.optim import BoostedOptimizer


def save_optimizer_state(opt: BoostedOptimizer, directory: Path, rank: int) -> None:
    """Every rank calls this; replicated optimizers are written by rank 0 only."""
    if opt.replicated and rank != 0:
        return
    pieces: list[OptimPiece] = []
    for master, refs in opt.owned():
        state = opt.optim.state.get(master, {})
        flat = {k: v.view(-1) for k, v in state.items() if _is_elementwise(v, master)}
        flat[MASTER] = master.view(-1)
        for ref in refs:
            n = ref.end - ref.start
            pieces.append(
                OptimPiece(
                    ref.name, ref.start, ref.end, {k: v[ref.offset : ref.offset + n] for k, v in flat.items()}
                )
            )
    write_pieces(directory, rank, pieces)
    if rank == 0:
        write_meta(directory, _meta(opt))


def _is_elementwise(value: Any, master: torch.Tensor) -> bool:
    return isinstance(value, torch.Tensor) and value.numel() == master.numel() and master.numel() > 1


def _meta(opt: BoostedOptimizer) -> dict[str, Any]:
    groups = []
    owned = {id(m): refs for m, refs in opt.owned()}
    for group in opt.param_groups:
        hyper = {k: v for k, v in group.items() if k != "params" and _json_scalar(v)}
        scalars: dict[str, float] = {}
        keys: set[str] = set()
        for m in group["params"]:
            for k, v in opt.optim.state.get(m, {}).items():
                if _is_elementwise(v, m):
                    keys.add(k)
                elif isinstance(v, torch.Tensor) and v.numel() == 1:
                    scalars[k] = float(v.item())
                elif isinstance(v, int | float):
                    scalars[k] = float(v)
        names = [ref.name for m in group["params"] for ref in owned.get(id(m), [])]
        groups.append({"hyper": hyper, "scalars": scalars, "tensor_keys": sorted(keys), "names": names})
    meta: dict[str, Any] = {"optimizer": type(opt.optim).__name__, "groups": groups}
    if opt.scaler is not None:
        meta["scaler"] = opt.scaler.state_dict()
    return meta


def _json_scalar(v: Any) -> bool:
    if isinstance(v, tuple | list):
        return all(isinstance(x, int | float | bool) for x in v)
    return v is None or isinstance(v, int | float | bool | str)


def load_optimizer_state(opt: BoostedOptimizer, directory: Path) -> None:
    """Every rank calls this (it publishes the loaded masters into the model, a collective for ZeRO)."""
    reader = PieceReader(directory)
    meta = reader.meta
    if meta.get("optimizer") != type(opt.optim).__name__:
        raise CheckpointError(
            f"optimizer checkpoint {directory} was written by {meta.get('optimizer')}, "
            f"not {type(opt.optim).__name__}"
        )
    if len(meta["groups"]) != len(opt.param_groups):
        raise CheckpointError(
            f"optimizer checkpoint has {len(meta['groups'])} param groups, the optimizer has {len(opt.param_groups)}"
        )
    missing = sorted({ref.name for _, refs in opt.owned() for ref in refs} - reader.names())
    if missing:
        raise CheckpointError(f"optimizer checkpoint {directory} has no state for parameter {missing[0]!r}")
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
    if not saved["tensor_keys"]:
        return
    state: dict[str, Any] = {}
    for key in saved["tensor_keys"]:
        t = torch.zeros(master.numel(), dtype=master.dtype, device=master.device)
        for ref in refs:
            n = ref.end - ref.start
            t[ref.offset : ref.offset + n] = reader.read(ref.name, key, ref.start, ref.end)
        state[key] = t.view_as(master)
    for key, value in saved["scalars"].items():
        state[key] = torch.tensor(value, dtype=torch.float32)
    opt.optim.state[master] = state
