"""Optimizer state as per-rank shards plus metadata, readable at any dp size or plugin.

Each rank writes the pieces of flattened parameters it owns:
    optimizer/rank_00003.safetensors   tensors "NAME::KEY" (e.g. "model.norm.weight::exp_avg"),
                                        metadata: NAME → [start, end) of the flattened parameter
    optimizer/meta.json                 param groups (hyper-parameters, member names), scalar state
A reader at another world size assembles any [start, end) range of any parameter from whichever
files hold it, so ZeRO dp=4 → dp=2 or → DDP needs no conversion step.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from megalith.checkpoint.state_io import UNREADABLE, read_json
from megalith.common.errors import CheckpointError

SEP = "::"
MASTER = "master"  # the state key of a parameter's (fp32) master copy
SCALAR = "#"  # prefix of scalar state keys in a sharded (DCP) optimizer checkpoint ("#step")
_UNREADABLE: tuple[type[BaseException], ...] = (SafetensorError, *UNREADABLE)  # a damaged shard file


@dataclass(frozen=True)
class OptimPiece:
    """Elements [start, end) of flattened parameter `name`, with one tensor per state key."""

    name: str
    start: int
    end: int
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)


def write_pieces(directory: Path, rank: int, pieces: list[OptimPiece]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    ranges: dict[str, list[int]] = {}
    for piece in pieces:
        ranges[piece.name] = [piece.start, piece.end]
        for key, t in piece.tensors.items():
            tensors[f"{piece.name}{SEP}{key}"] = t.detach().cpu().contiguous()
    save_file(
        tensors, str(directory / f"rank_{rank:05d}.safetensors"), metadata={"ranges": json.dumps(ranges)}
    )


def write_meta(directory: Path, meta: dict[str, Any]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "meta.json").write_text(json.dumps(meta, indent=2, sort_keys=True))


class PieceReader:
    """Reads arbitrary ranges of saved optimizer state, whatever world size wrote it."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        meta_path = directory / "meta.json"
        if not meta_path.exists():
            raise CheckpointError(f"{meta_path}: missing (optimizer checkpoint {directory} has no meta.json)")
        self.meta: dict[str, Any] = read_json(meta_path)
        self._index: dict[str, list[tuple[int, int, Path]]] = {}
        self._keys: dict[str, dict[str, Path]] = {}  # parameter → state key → a file holding it
        files = sorted(directory.glob("rank_*.safetensors"))
        if not files:
            raise CheckpointError(f"optimizer checkpoint {directory} has no rank_*.safetensors shards")
        for path in files:
            self._add_file(path)

    def _add_file(self, path: Path) -> None:
        try:
            with safe_open(str(path), framework="pt") as f:
                ranges = json.loads((f.metadata() or {}).get("ranges", "{}"))
                for full_key in f.keys():
                    name, _, key = full_key.partition(SEP)
                    self._keys.setdefault(name, {}).setdefault(key, path)
            pairs = [(name, int(start), int(end)) for name, (start, end) in ranges.items()]
        except _UNREADABLE as exc:
            raise CheckpointError(f"{path}: cannot be read ({type(exc).__name__}: {exc})") from exc
        for name, start, end in pairs:
            self._index.setdefault(name, []).append((start, end, path))

    def names(self) -> set[str]:
        return set(self._index)

    def keys(self, name: str) -> set[str]:
        """The state keys saved for parameter `name` ("master", "exp_avg", "#step", ...)."""
        return set(self._keys.get(name, {}))

    def read_scalar(self, name: str, key: str) -> torch.Tensor:
        """The 1-element scalar state `key` ("#step") of parameter `name`."""
        path = self._keys.get(name, {}).get(key)
        if path is None:
            raise CheckpointError(f"optimizer checkpoint {self.directory} has no state {key!r} for {name!r}")
        with safe_open(str(path), framework="pt") as f:
            return f.get_tensor(f"{name}{SEP}{key}")

    def numel(self, name: str) -> int | None:
        """numel of flattened parameter `name` as saved (the end of its last piece), None if absent."""
        ranges = self._index.get(name)
        return max(hi for _, hi, _ in ranges) if ranges else None

    def read(self, name: str, key: str, start: int, end: int) -> torch.Tensor:
        """Elements [start, end) of state `key` of flattened parameter `name`."""
        if name not in self._index:
            raise CheckpointError(
                f"optimizer checkpoint {self.directory} has no state for parameter {name!r}"
            )
        out: torch.Tensor | None = None
        covered = 0
        for lo, hi, path in sorted(self._index[name]):
            a, b = max(lo, start), min(hi, end)
            if a >= b:
                continue
            with safe_open(str(path), framework="pt") as f:
                full_key = f"{name}{SEP}{key}"
                if full_key not in f.keys():
                    raise CheckpointError(f"{path} has no state {key!r} for parameter {name!r}")
                part = f.get_slice(full_key)[a - lo : b - lo]
            if out is None:
                out = torch.empty(end - start, dtype=part.dtype)
            out[a - start : b - start] = part
            covered += b - a
        if out is None or covered != end - start:
            raise CheckpointError(
                f"optimizer checkpoint {self.directory} covers {covered} of elements [{start}, {end}) of {name!r}"
            )
        return out
