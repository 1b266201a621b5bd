"""The Booster's sharded checkpoints on DCP (`megalith.checkpoint.dcp`): model and optimizer.

    CKPT/model_sharded/   DCP: one 1-D tensor per model state-dict entry (tied ones once), named
                          like the state dict; meta.json holds the shapes (+ config.json)
    CKPT/optimizer/       DCP: "NAME::KEY" per parameter NAME for every elementwise state (Adam's
                          exp_avg, exp_avg_sq, and "master", the fp32 master values) as the
                          flattened parameter's 1-D tensor; "NAME::#KEY" for a scalar state (Adam's
                          step) as a 1-element tensor written by every rank holding a piece of NAME
                          (DCP keeps one copy); meta.json holds the hyper-parameters per group.

Every rank writes the pieces it owns (`Plugin.model_pieces`, `BoostedOptimizer.owned()`);
replicated state (DDP, ZeRO-1/2 parameters) is split evenly over the ranks. Loading requests
exactly the ranges this rank owns in the new layout, so any plugin / world size loads any other.

Asynchronous save: `SaveJob.snapshot()` copies every piece to CPU (pinned, non-blocking on CUDA,
then one synchronize) and a background thread writes them and commits the staging directory; the
thread's collectives run on a dedicated gloo group so they never interleave with training's.
"""

from __future__ import annotations

import atexit
import logging
import math
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megalith.booster.optim_state import (
    check_optimizer_meta,
    check_param_numels,
    is_elementwise_state,
    is_json_hyper,
    scalar_state,
)
from megalith.booster.plugins.base import Plugin, unique_state
from megalith.checkpoint.atomic import commit, fresh_staging, staging_path
from megalith.checkpoint.dcp import (
    DCPModelReader,
    DCPReader,
    FlatPiece,
    Request,
    cpu_copy,
    save_pieces,
    split_for_rank,
)
from megalith.checkpoint.optimizer_io import MASTER, SCALAR, SEP
from megalith.common.errors import CheckpointError
from megalith.optim import BoostedOptimizer, PieceRef

logger = logging.getLogger(__name__)


def _rank_world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


# -- model ----------------------------------------------------------------------------------------
def model_shapes(plugin: Plugin, model: nn.Module) -> dict[str, list[int]]:
    """The full shape of every model state entry as a checkpoint records it (`meta.json` "shapes")
    and as a load must find it: replicated plugins' own tensors; the full tensors of tp blocks
    (`model_shapes` of the plugin); DTensor and ZeRO-3 parameters report their full shapes."""
    if not plugin.sharded_params:
        return {n: list(t.shape) for n, t in unique_state(plugin.unwrap(model)).items()}
    full_shapes = getattr(plugin, "model_shapes", None)
    if full_shapes is not None:
        return {n: list(shape) for n, (shape, _) in full_shapes(model).items()}
    return {n: list(t.shape) for n, t in model.state_dict(keep_vars=True).items()}


def model_pieces(plugin: Plugin, model: nn.Module) -> tuple[list[FlatPiece], dict[str, Any]]:
    """This rank's model pieces and the meta.json content (shapes of every entry)."""
    rank, world = _rank_world()
    if plugin.sharded_params:
        shapes = model_shapes(plugin, model)
        raw = plugin.model_pieces(model)
        pieces = [FlatPiece(n, s, math.prod(shapes[n]), t.reshape(-1)) for n, s, _, t in raw]
    else:  # replicated parameters: every rank writes 1/world of every tensor
        state = unique_state(plugin.unwrap(model))
        shapes = {n: list(t.shape) for n, t in state.items()}
        full = [FlatPiece(n, 0, t.numel(), t.detach().reshape(-1)) for n, t in state.items()]
        pieces = split_for_rank(full, rank, world)
    return pieces, {"kind": "model", "shapes": shapes}


def model_reader(plugin: Plugin, model: nn.Module, directory: Path) -> DCPModelReader:
    """A reader for `plugin.load_model_pieces` that expects the ranges the plugin will read, so
    they arrive in a few batched DCP loads: full tensors for replicated plugins and for those that
    slice blocks out of full tensors (tensor parallel, `model_shapes`), else the pieces this rank
    holds (`model_pieces`, e.g. ZeRO-3 and FSDP shards; anything else is read on demand)."""
    reader = DCPModelReader(directory)
    full_shapes = getattr(plugin, "model_shapes", None)
    if not plugin.sharded_params:
        expected = [(n, 0, t.numel()) for n, t in unique_state(plugin.unwrap(model)).items()]
    elif full_shapes is not None:
        expected = [(n, 0, math.prod(shape)) for n, (shape, _) in full_shapes(model).items()]
    else:
        expected = [(n, s, e) for n, s, e, _ in plugin.model_pieces(model)]
    reader.dcp.expect([r for r in expected if r[0] in reader.shapes])
    return reader


# -- optimizer ------------------------------------------------------------------------------------
def _is_scalar(fqn: str) -> bool:
    return f"{SEP}{SCALAR}" in fqn


def _master_pieces(
    opt: BoostedOptimizer, master: torch.Tensor, refs: list[PieceRef], totals: dict[str, int]
) -> list[FlatPiece]:
    state = opt.optim.state.get(master, {})
    flat = {MASTER: master.detach().view(-1)}
    scalars: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if is_elementwise_state(value, master):
            flat[key] = value.detach().view(-1)
        elif (s := scalar_state(value)) is not None:
            scalars[key] = s
        else:
            raise CheckpointError(
                f"optimizer state {key!r} of shape {tuple(getattr(value, 'shape', ()))} is neither "
                f"elementwise nor scalar (master of shape {tuple(master.shape)}): cannot reshard it"
            )
    out = []
    for ref in refs:
        n = ref.end - ref.start
        for key, t in flat.items():
            out.append(
                FlatPiece(
                    f"{ref.name}{SEP}{key}", ref.start, totals[ref.name], t[ref.offset : ref.offset + n]
                )
            )
        out += [FlatPiece(f"{ref.name}{SEP}{SCALAR}{k}", 0, 1, v) for k, v in scalars.items()]
    return out


def _totals(opt: BoostedOptimizer, group: Any) -> dict[str, int]:
    """numel of every parameter: the pieces of all ranks tile [0, numel), so it is the largest
    piece end over the ranks (one all_gather_object)."""
    ends: dict[str, int] = {}
    for _, refs in opt.owned():
        for ref in refs:
            ends[ref.name] = max(ends.get(ref.name, 0), ref.end)
    if not dist.is_initialized():
        return ends
    everyone: list[dict[str, int] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, ends, group=group)
    out: dict[str, int] = {}
    for part in everyone:
        for name, end in (part or {}).items():
            out[name] = max(out.get(name, 0), end)
    return out


def optimizer_pieces(opt: BoostedOptimizer, group: Any = None) -> tuple[list[FlatPiece], dict[str, Any]]:
    """This rank's optimizer pieces and the meta.json content (a collective over `group`)."""
    rank, world = _rank_world()
    totals = _totals(opt, group)
    pieces: list[FlatPiece] = []
    for master, refs in opt.owned():
        pieces += _master_pieces(opt, master, refs, totals)
    if opt.replicated and world > 1:  # every rank holds everything: split the elementwise pieces
        scalars = [p for p in pieces if _is_scalar(p.fqn)]
        pieces = scalars + split_for_rank([p for p in pieces if not _is_scalar(p.fqn)], rank, world)
    hyper = [{k: v for k, v in g.items() if k != "params" and is_json_hyper(v)} for g in opt.param_groups]
    names = opt.group_param_names()  # each group's parameters: a load refuses groups holding others
    meta: dict[str, Any] = {
        "kind": "optimizer",
        "optimizer": type(opt.optim).__name__,
        "groups": [{"hyper": h, "names": n} for h, n in zip(hyper, names, strict=True)],
    }
    if opt.scaler is not None:
        meta["scaler"] = opt.scaler.state_dict()
    return pieces, meta


def _saved_keys(reader: DCPReader) -> dict[str, set[str]]:
    """Parameter name → the state keys saved for it ("#step" for scalar ones)."""
    out: dict[str, set[str]] = {}
    for fqn in reader.fqns():
        name, _, key = fqn.partition(SEP)
        out.setdefault(name, set()).add(key)
    return out


def load_optimizer_dcp(opt: BoostedOptimizer, directory: Path, reader: DCPReader | None = None) -> None:
    """Every rank reads exactly the ranges it owns (then publishes the masters: a collective for ZeRO).
    `reader`: one that maps the optimizer's piece coordinates onto the saved tensors (tensor
    parallelism: `ShardedDCPReader`); a plain `DCPReader` of `directory` by default."""
    reader = reader or DCPReader(directory)
    check_optimizer_dcp(opt, reader, directory)
    meta = reader.meta
    saved = _saved_keys(reader)
    owned = opt.owned()
    reader.expect(_requests(owned, saved))
    for group, saved_group in zip(opt.param_groups, meta["groups"], strict=True):
        group.update({k: tuple(v) if isinstance(v, list) else v for k, v in saved_group["hyper"].items()})
    for master, refs in owned:
        _load_master_state(opt, master, refs, saved, reader)
    opt.load_master_values(lambda name, s, e: reader.read(f"{name}{SEP}{MASTER}", s, e))
    if opt.scaler is not None and "scaler" in meta:
        opt.scaler.load_state_dict(meta["scaler"])


def check_optimizer_dcp(opt: BoostedOptimizer, reader: DCPReader, directory: Path) -> None:
    """Everything `load_optimizer_dcp` checks before it changes anything: meta.json (optimizer
    class, param groups and the parameters each holds), every owned parameter saved, its size."""
    if not reader.meta:
        raise CheckpointError(f"{directory / 'meta.json'}: missing (optimizer checkpoint {directory})")
    check_optimizer_meta(opt, reader.meta, directory)
    saved = _saved_keys(reader)
    owned = opt.owned()
    missing = sorted({r.name for _, refs in owned for r in refs if MASTER not in saved.get(r.name, ())})
    if missing:
        raise CheckpointError(f"optimizer checkpoint {directory} has no state for parameter {missing[0]!r}")
    check_param_numels(opt.param_numels(), reader.master_numel, directory)


def _requests(owned: list[tuple[torch.Tensor, list[PieceRef]]], saved: dict[str, set[str]]) -> list[Request]:
    """The ranges `load_optimizer_dcp` reads, in the order it reads them (states, then masters)."""
    states: list[Request] = []
    for _, refs in owned:
        for key in sorted({k for ref in refs for k in saved[ref.name] if k != MASTER}):
            having = [ref for ref in refs if key in saved[ref.name]]
            if key.startswith(SCALAR):  # read from the first parameter that has it
                states.append((f"{having[0].name}{SEP}{key}", 0, 1))
            else:
                states += [(f"{r.name}{SEP}{key}", r.start, r.end) for r in having]
    masters = [(f"{ref.name}{SEP}{MASTER}", ref.start, ref.end) for _, refs in owned for ref in refs]
    return states + masters


def _load_master_state(
    opt: BoostedOptimizer,
    master: torch.Tensor,
    refs: list[PieceRef],
    saved: dict[str, set[str]],
    reader: DCPReader,
) -> None:
    """State of one master from its pieces; a state saved for some of its parameters only (one
    never updated) starts at zero for the others, as the optimizer would have created it."""
    keys = sorted({k for ref in refs for k in saved[ref.name] if k != MASTER})
    state: dict[str, Any] = {}
    for key in keys:
        if key.startswith(SCALAR):
            name = next(r.name for r in refs if key in saved[r.name])
            state[key[len(SCALAR) :]] = reader.read(f"{name}{SEP}{key}", 0, 1).reshape(())
            continue
        flat = torch.zeros(master.numel(), dtype=master.dtype, device=master.device)
        for ref in refs:
            if key in saved[ref.name]:
                part = reader.read(f"{ref.name}{SEP}{key}", ref.start, ref.end)
                flat[ref.offset : ref.offset + ref.end - ref.start].copy_(part)
        state[key] = flat.view_as(master)
    if state:
        opt.optim.state[master] = state
    else:
        opt.optim.state.pop(master, None)


# -- writing: synchronous or in the background ------------------------------------------------------
MODEL_DIR = "model_sharded"
OPTIM_DIR = "optimizer"


@dataclass(frozen=True)
class DCPPart:
    """One DCP directory to write: this rank's pieces, and rank 0's meta.json content."""

    directory: Path
    pieces: list[FlatPiece]
    meta: dict[str, Any]


@dataclass(frozen=True)
class SaveJob:
    parts: list[DCPPart]

    def snapshot(self) -> SaveJob:
        """The same job on private CPU copies (pinned + non-blocking on CUDA, one synchronize)."""
        on_cuda = any(p.values.is_cuda for part in self.parts for p in part.pieces)
        parts = [
            replace(part, pieces=[replace(p, values=cpu_copy(p.values, pin=on_cuda)) for p in part.pieces])
            for part in self.parts
        ]
        if on_cuda:
            torch.cuda.synchronize()
        return SaveJob(parts)

    def write(self, group: Any = None) -> None:
        """Collective over `group`: every part with DCP."""
        for part in self.parts:
            save_pieces(part.directory, part.pieces, part.meta, group)


def state_job(
    plugin: Plugin, model: nn.Module, optimizer: BoostedOptimizer, staging: Path, group: Any
) -> SaveJob:
    """Model and optimizer pieces of `save_state` (a collective). A plugin with its own optimizer
    writer (`save_optimizer_state`, tensor parallel) writes that part now, in its own format."""
    parts = [DCPPart(staging / MODEL_DIR, *model_pieces(plugin, model))]
    custom = getattr(plugin, "save_optimizer_state", None)
    if custom is not None:
        custom(optimizer, staging / OPTIM_DIR)
    else:
        parts.append(DCPPart(staging / OPTIM_DIR, *optimizer_pieces(optimizer, group)))
    return SaveJob(parts)


def checkpoint_group(holder: Any, async_save: bool) -> Any:
    """The group for checkpoint collectives: the default one when it is gloo and the save is
    synchronous; else a gloo group made once per `holder` (collectively) — async saves run their
    collectives from a thread, which must never interleave with training's on the same group."""
    if not dist.is_initialized() or (not async_save and dist.get_backend() == "gloo"):
        return None
    group = getattr(holder, "_megalith_ckpt_group", None)
    if group is None:
        group = dist.new_group(backend="gloo")
        holder._megalith_ckpt_group = group
    return group


EXIT_WAIT_S = 600.0  # how long interpreter exit waits for asynchronous saves still being written
_IN_FLIGHT: weakref.WeakSet[AsyncCheckpoint] = weakref.WeakSet()


class AsyncCheckpoint:
    """Handle of a `save_state(..., async_save=True)`: the pieces were copied to CPU; a thread
    writes them and rank 0 commits the staging directory. `wait()` (collective) returns the path
    once the checkpoint is committed on every rank, or raises the CheckpointError of the save.

    A program that exits without waiting still gets its checkpoint: an exit hook waits up to
    `EXIT_WAIT_S` for saves in flight (the thread is a daemon so that a save stuck on a dead rank
    cannot hold the exit forever; one cut off that way leaves only its staging directory, and the
    previous checkpoint stays intact)."""

    def __init__(self, path: Path, job: SaveJob, group: Any, commit: Callable[[Path], Any]) -> None:
        self.path = path
        self._job, self._group, self._commit = job, group, commit
        self._error: str | None = None
        self._thread = threading.Thread(target=self._run, name=f"checkpoint-{path.name}", daemon=True)
        self._thread.start()
        _IN_FLIGHT.add(self)

    def _run(self) -> None:
        rank, world = _rank_world()
        error = None
        try:
            self._job.write(self._group)
            if rank == 0:
                self._commit(self.path)
        except Exception as exc:
            error = f"rank {rank}: {type(exc).__name__}: {exc}"
            logger.exception("asynchronous save of %s failed", self.path)
        errors: list[str | None] = [error]
        if world > 1:  # the commit (or a failure anywhere) becomes visible to every rank
            errors = [None] * world
            dist.all_gather_object(errors, error, group=self._group)
        self._error = "; ".join(e for e in errors if e) or None
        self._job = SaveJob([])  # free the CPU copies

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> Path:
        self._thread.join()
        if self._error:
            raise CheckpointError(f"asynchronous save of {self.path} failed: {self._error}")
        return self.path


@atexit.register
def _finish_saves_in_flight() -> None:
    """Exit hook: let asynchronous saves that nobody waited for finish (see `AsyncCheckpoint`)."""
    deadline = time.monotonic() + EXIT_WAIT_S
    for pending in list(_IN_FLIGHT):
        if not pending.done():
            logger.info("waiting for the asynchronous save of %s before exiting", pending.path)
            pending._thread.join(max(0.0, deadline - time.monotonic()))
        if not pending.done():
            logger.warning("asynchronous save of %s did not finish before exit: not committed", pending.path)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def save_config(model: nn.Module, directory: Path) -> None:
    """An HF model's config.json next to its weights (for `export_hf` / `from_pretrained`)."""
    directory.mkdir(parents=True, exist_ok=True)
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "save_pretrained"):
        config.save_pretrained(str(directory))


def save_model_dcp(plugin: Plugin, model: nn.Module, path: Path) -> Path:
    """The model as a sharded DCP directory (+ config.json), written atomically; a collective."""
    rank, _ = _rank_world()
    if rank == 0:
        fresh_staging(path)
    _barrier()
    staging = staging_path(path)
    pieces, meta = model_pieces(plugin, model)
    save_pieces(staging, pieces, meta)
    if rank == 0:
        save_config(plugin.unwrap(model), staging)
    _barrier()
    if rank == 0:
        commit(path)
    _barrier()
    return path
