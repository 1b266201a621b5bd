"""Training state for exact resume: step, scheduler, sampler position and every RNG, per rank."""

from __future__ import annotations

import json
import pickle
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from megalith.common.errors import CheckpointError

# What unpickling / unzipping a damaged file raises (truncated: EOFError, UnpicklingError, torch's
# "PytorchStreamReader failed" RuntimeError; garbage: ValueError, IndexError, ...): turned into a
# CheckpointError naming the file, never passed on bare.
UNREADABLE: tuple[type[BaseException], ...] = (
    pickle.UnpicklingError,
    EOFError,
    OSError,
    RuntimeError,
    ValueError,
    TypeError,
    AttributeError,
    ImportError,
    IndexError,
    KeyError,
)


def capture_rng() -> dict[str, Any]:
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def write_rng(directory: Path, rank: int) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    torch.save(capture_rng(), rng_path(directory, rank))


def rng_path(directory: Path, rank: int) -> Path:
    return directory / f"rng_rank_{rank:05d}.pt"


def read_rng(directory: Path, rank: int) -> dict[str, Any]:
    path = rng_path(directory, rank)
    if not path.exists():
        raise CheckpointError(f"{path}: no RNG state for rank {rank} in {directory}")
    # Our own file (python/numpy RNG states are plain tuples and arrays).
    return load_torch_file(path, ("python", "numpy", "torch"))


def load_torch_file(path: Path, keys: tuple[str, ...] = ()) -> dict[str, Any]:
    """A dict that megalith itself `torch.save`d (not weights only: scheduler / sampler / RNG state),
    with `keys`; a missing, truncated or foreign file is a CheckpointError naming it."""
    if not path.is_file():
        raise CheckpointError(f"{path}: missing")
    try:
        data = torch.load(path, weights_only=False)
    except UNREADABLE as exc:
        raise CheckpointError(f"{path}: cannot be read ({type(exc).__name__}: {exc})") from exc
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a dict, got {type(data).__name__}")
    missing = [k for k in keys if k not in data]
    if missing:
        raise CheckpointError(f"{path}: missing key {missing[0]!r}")
    return data


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=True, default=_jsonable))


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object file; missing, unreadable or not an object: a CheckpointError naming it."""
    if not path.is_file():
        raise CheckpointError(f"{path}: missing")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, OSError) as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.tolist()
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(f"cannot serialise {type(obj).__name__} to JSON")
