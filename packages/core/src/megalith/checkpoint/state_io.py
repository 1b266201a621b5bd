"""Training state for exact resume: step, scheduler, sampler position and every RNG, per rank."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from megalith.common.errors import CheckpointError


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
    torch.save(capture_rng(), directory / f"rng_rank_{rank:05d}.pt")


def read_rng(directory: Path, rank: int) -> dict[str, Any]:
    path = directory / f"rng_rank_{rank:05d}.pt"
    if not path.exists():
        raise CheckpointError(f"no RNG state for rank {rank} in {directory}")
    # Our own file (python/numpy RNG states are plain tuples and arrays).
    return torch.load(path, weights_only=False)


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=True, default=_jsonable))


def read_json(path: Path) -> dict[str, Any]:
    if not path.exists():
        raise CheckpointError(f"missing {path}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from exc


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.tolist()
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(f"cannot serialise {type(obj).__name__} to JSON")
