"""What `Booster.load_state` checks before it changes anything.

A `save_state` directory:

    state.json        {"format", "step", "world_size", "plugin", "precision", "extra"}
    trainer.pt        {"lr_scheduler": ..., "dataloader": ...}
    rng/rng_rank_R.pt python / numpy / torch RNG of rank R
    model_sharded/    DCP: .metadata, __R_0.distcp, meta.json  (or model/ of an earlier format)
    optimizer/        DCP (.metadata, meta.json, shards) or the per-rank piece format

Every file is checked to exist, the small ones (state.json, trainer.pt, this rank's RNG, both
meta.json and .metadata, the shard sizes) are parsed, and the optimizer's metadata is compared with
the optimizer, all before the model's weights are touched: a damaged directory is a CheckpointError
naming the file and leaves model and optimizer as they were. The ranks agree on the outcome (one
all_gather), so a file that only one rank reads cannot leave the others waiting in a collective.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch.distributed as dist

from megalith.booster.checkpointing import MODEL_DIR, OPTIM_DIR, check_optimizer_dcp
from megalith.booster.optim_state import check_optimizer_pieces
from megalith.checkpoint import DCPReader, PieceReader, is_dcp, read_json, read_rng
from megalith.checkpoint.dcp import META, read_dcp_metadata
from megalith.checkpoint.state_io import load_torch_file
from megalith.common.errors import CheckpointError
from megalith.optim import BoostedOptimizer

STATE_KEYS = ("format", "step", "world_size")
TRAINER_KEYS = ("lr_scheduler", "dataloader")
T = TypeVar("T")


@dataclass(frozen=True)
class StateFiles:
    """The parsed small files of a `save_state` directory and the opened optimizer reader."""

    meta: dict[str, Any]  # state.json
    trainer: dict[str, Any]  # trainer.pt
    rng: dict[str, Any]  # this rank's RNG state (rank 0's when the world size changed)
    model_dir: Path
    optim_dir: Path
    optim_reader: DCPReader | PieceReader


def read_state_json(root: Path, state_format: int) -> dict[str, Any]:
    """state.json with its required keys, of format `state_format`, world_size a positive int."""
    path = root / "state.json"
    meta = read_json(path)
    missing = [k for k in STATE_KEYS if k not in meta]
    if missing:
        raise CheckpointError(f"{path}: missing key {missing[0]!r}")
    if meta["format"] != state_format:
        raise CheckpointError(f"{path}: state format {meta['format']!r}, expected {state_format}")
    world = meta["world_size"]
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise CheckpointError(f"{path}: world_size must be a positive integer, got {world!r}")
    return meta


def open_optimizer_dir(directory: Path) -> DCPReader | PieceReader:
    """The reader of an optimizer checkpoint (DCP or per-rank pieces): metadata parsed, shard
    files present (and, for DCP, as long as the metadata records)."""
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: missing optimizer checkpoint directory")
    if is_dcp(directory) or any(directory.glob("*.distcp")):
        reader = DCPReader(directory)
        if not reader.meta:
            raise CheckpointError(f"{directory / META}: missing (optimizer checkpoint {directory})")
        return reader
    return PieceReader(directory)


def _check_model_dir(root: Path) -> Path:
    model_dir = root / MODEL_DIR if (root / MODEL_DIR).exists() else root / "model"
    if not model_dir.is_dir():
        raise CheckpointError(f"{root / MODEL_DIR}: missing model checkpoint directory")
    if model_dir.name == MODEL_DIR:  # save_state writes DCP with meta.json (the saved shapes)
        read_dcp_metadata(model_dir)
        read_json(model_dir / META)
    return model_dir


def read_state_files(root: Path, rank: int, world: int, state_format: int) -> StateFiles:
    """Every file of `root` present and its small files parsed (see the module docstring)."""
    meta = read_state_json(root, state_format)
    model_dir = _check_model_dir(root)
    optim_reader = open_optimizer_dir(root / OPTIM_DIR)
    trainer = load_torch_file(root / "trainer.pt", TRAINER_KEYS)
    rng = read_rng(root / "rng", rank if meta["world_size"] == world else 0)
    return StateFiles(meta, trainer, rng, model_dir, root / OPTIM_DIR, optim_reader)


def check_optimizer(optimizer: BoostedOptimizer, files: StateFiles) -> None:
    """The optimizer metadata against `optimizer` (class, param groups and their parameters, sizes)."""
    if isinstance(files.optim_reader, DCPReader):
        check_optimizer_dcp(optimizer, files.optim_reader, files.optim_dir)
    else:
        check_optimizer_pieces(optimizer, files.optim_reader, files.optim_dir)


def agreed(check: Callable[[], T]) -> T:
    """`check()` on every rank; if it raised a CheckpointError on any rank, every rank raises one
    (its own, or the first failing rank's), so no rank goes on into a collective alone."""
    result: T | None = None
    error: CheckpointError | None = None
    try:
        result = check()
    except CheckpointError as exc:
        error = exc
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, None if error is None else str(error))
        failed = [(r, e) for r, e in enumerate(everyone) if e is not None]
        if error is None and failed:
            raise CheckpointError(f"rank {failed[0][0]}: {failed[0][1]}")
    if error is not None:
        raise error
    return result  # type: ignore[return-value]
