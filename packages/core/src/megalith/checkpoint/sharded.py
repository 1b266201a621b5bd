"""Sharded model weights: every rank writes the pieces of flattened parameters it holds; any
world size and any plugin reads back any range — no rank ever gathers the full model.

    model_sharded/rank_00003.safetensors   "NAME::value" pieces; metadata NAME → [start, end)
    model_sharded/meta.json                {"format": "megalith-model-pieces", "files": [...],
                                            "shapes": {NAME: shape}, "dtypes": {NAME: dtype}}

The same piece machinery as the optimizer checkpoints (`optimizer_io.py`). `export_hf` streams a
sharded checkpoint into an HF safetensors directory one tensor at a time (memory: one output shard).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from megalith.checkpoint.dcp import is_dcp, iter_full_tensors
from megalith.checkpoint.model_io import INDEX_NAME, WEIGHTS_NAME, weight_files
from megalith.checkpoint.optimizer_io import OptimPiece, PieceReader, write_meta, write_pieces
from megalith.checkpoint.state_io import read_json
from megalith.common.errors import CheckpointError

FORMAT = "megalith-model-pieces"
VALUE = "value"


def write_model_pieces(
    directory: Path,
    rank: int,
    world: int,
    pieces: list[tuple[str, int, int, torch.Tensor]],
    shapes: dict[str, tuple[list[int], str]],
) -> None:
    """This rank's (name, start, end, flat values) pieces; rank 0 also writes meta.json."""
    write_pieces(directory, rank, [OptimPiece(n, s, e, {VALUE: t}) for n, s, e, t in pieces])
    if rank == 0:
        meta = {
            "format": FORMAT,
            "files": [f"rank_{r:05d}.safetensors" for r in range(world)],
            "shapes": {n: s for n, (s, _) in shapes.items()},
            "dtypes": {n: d for n, (_, d) in shapes.items()},
        }
        write_meta(directory, meta)


def is_sharded_model(directory: Path) -> bool:
    meta = directory / "meta.json"
    return meta.exists() and read_json(meta).get("format") == FORMAT


class ModelReader:
    """`read(name, start, end)` → elements [start, end) of flattened tensor `name`, from a sharded
    model directory or an HF safetensors directory (one full tensor cached at a time)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.sharded = is_sharded_model(directory)
        self._cached: tuple[str, torch.Tensor] | None = None
        if self.sharded:
            meta = read_json(directory / "meta.json")
            if not isinstance(meta.get("files"), list) or not isinstance(meta.get("shapes"), dict):
                raise CheckpointError(
                    f"{directory / 'meta.json'}: needs 'files' (a list) and 'shapes' (a dict)"
                )
            for fname in meta["files"]:
                if not (directory / fname).exists():
                    raise CheckpointError(f"sharded checkpoint {directory} is missing shard file {fname}")
            self.pieces = PieceReader(directory)
            self.shapes = {n: tuple(s) for n, s in meta["shapes"].items()}
        else:
            self.files = weight_files(directory)
            self.shapes = {}
            for name, path in self.files.items():
                with safe_open(str(path), framework="pt") as f:
                    self.shapes[name] = tuple(f.get_slice(name).get_shape())

    def names(self) -> set[str]:
        return set(self.shapes)

    def read(self, name: str, start: int, end: int) -> torch.Tensor:
        if name not in self.shapes:
            raise CheckpointError(f"checkpoint {self.directory} has no tensor {name!r}")
        if self.sharded:
            return self.pieces.read(name, VALUE, start, end)
        if self._cached is None or self._cached[0] != name:
            with safe_open(str(self.files[name]), framework="pt") as f:
                self._cached = (name, f.get_tensor(name).reshape(-1))
        return self._cached[1][start:end]

    def full(self, name: str) -> torch.Tensor:
        numel = 1
        for d in self.shapes[name]:
            numel *= d
        return self.read(name, 0, numel).view(self.shapes[name])


def write_hf_streamed(
    items: Iterable[tuple[str, torch.Tensor]], directory: Path | None, max_shard_bytes: int
) -> None:
    """Write (name, full tensor) items as HF safetensors shards as they come (rank 0 passes a
    directory; the others pass None and only drive the iterator, which may be a collective)."""
    shards: list[list[str]] = []
    part: dict[str, torch.Tensor] = {}
    size = total = 0

    def flush() -> None:
        nonlocal part, size
        if part and directory is not None:
            save_file(part, str(directory / f"part-{len(shards):05d}.safetensors"), metadata={"format": "pt"})
            shards.append(list(part))
        part, size = {}, 0

    for name, t in items:
        if directory is None:
            continue
        nbytes = t.numel() * t.element_size()
        if part and size + nbytes > max_shard_bytes:
            flush()
        part[name] = t.detach().cpu().contiguous()
        size += nbytes
        total += nbytes
    flush()
    if directory is not None:
        _name_shards(directory, shards, total)


def _name_shards(directory: Path, shards: list[list[str]], total: int) -> None:
    if len(shards) == 1:
        (directory / "part-00000.safetensors").rename(directory / WEIGHTS_NAME)
        return
    weight_map: dict[str, str] = {}
    for i, names in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        (directory / f"part-{i:05d}.safetensors").rename(directory / fname)
        weight_map.update(dict.fromkeys(names, fname))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / INDEX_NAME).write_text(json.dumps(index, indent=2))


def export_hf(sharded: Path, out: Path, max_shard_bytes: int = 2 * 2**30) -> Path:
    """Convert a sharded model checkpoint (DCP, or the earlier piece format) into an HF safetensors
    directory, tensor by tensor: memory is one full tensor plus one output shard. The model's
    config.json is copied next to it for `from_pretrained`."""
    if is_dcp(sharded):
        items: Iterator[tuple[str, torch.Tensor]] = iter_full_tensors(sharded)
    else:
        reader = ModelReader(sharded)
        if not reader.sharded:
            raise CheckpointError(
                f"{sharded} is not a sharded model checkpoint (no DCP .metadata, no {FORMAT} meta.json)"
            )
        items = ((name, reader.full(name)) for name in sorted(reader.names()))
    out.mkdir(parents=True, exist_ok=True)
    write_hf_streamed(items, out, max_shard_bytes)
    for extra in ("config.json", "generation_config.json"):
        if (sharded / extra).exists():
            (out / extra).write_text((sharded / extra).read_text())
    return out
