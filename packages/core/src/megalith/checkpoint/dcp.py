"""Sharded checkpoints on `torch.distributed.checkpoint` (DCP), resharding on load.

Every checkpointed tensor (a model parameter, an optimizer state of one parameter) is stored as
ONE 1-D DCP tensor of numel N — its flattened form — and each rank contributes the chunks
[start, end) it holds. That is exactly megalith's piece layout (`Plugin.model_pieces`, optimizer
`owned()` PieceRefs), so ZeRO-1/2/3, FSDP2, DDP and one process all write the same format:

    DIR/.metadata          DCP metadata: per FQN the global size (N,) and the saved chunks
                           (ChunkStorageMetadata offsets=(start,), sizes=(end-start,))
    DIR/__{rank}_0.distcp  the chunks that rank wrote (torch.save blobs, one per chunk)
    DIR/meta.json          megalith's own metadata (shapes, optimizer hyper-parameters, ...)

Route: a custom `SavePlanner` (subclass of DCP's default planner) emits one SHARD `WriteItem` per
local piece (ShardedTensor/DTensor cannot express uneven arbitrary 1-D ranges, or need collectives
per tensor to do so); DCP's global planning dedups identical chunks written by several ranks,
builds the metadata and validates that the chunks of every tensor tile [0, N) exactly. Loading
uses a custom `LoadPlanner` whose local plan is `create_read_items_for_chunk_list` of the ranges
THIS rank requests in its new layout: DCP reads only the overlapping parts of the saved chunks.
Loads run per rank without collectives (`no_dist=True`), so any layout reads any other and no
rank ever materialises more than what it asked for.
"""

from __future__ import annotations

import json
import logging
import math
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from megalith.checkpoint.optimizer_io import MASTER, SEP
from megalith.checkpoint.state_io import UNREADABLE, read_json
from megalith.common.errors import CheckpointError

logger = logging.getLogger(__name__)

FORMAT = "megalith-dcp"
META = "meta.json"
DCP_METADATA = ".metadata"

Request = tuple[str, int, int]  # (fqn, start, end) of a flattened tensor


@dataclass(frozen=True)
class FlatPiece:
    """Elements [start, start + values.numel()) of the flattened tensor `fqn` of numel `total`."""

    fqn: str
    start: int
    total: int
    values: torch.Tensor  # 1-D


def split_for_rank(pieces: Iterable[FlatPiece], rank: int, world: int) -> list[FlatPiece]:
    """Replicated state (every rank holds the same pieces): rank r writes the r-th of `world`
    equal slices of every piece, so all ranks write in parallel and nobody writes twice."""
    out = []
    for p in pieces:
        n = p.values.numel()
        lo, hi = rank * n // world, (rank + 1) * n // world
        if hi > lo:
            out.append(FlatPiece(p.fqn, p.start + lo, p.total, p.values[lo:hi]))
    return out


def cpu_copy(t: torch.Tensor, pin: bool = False) -> torch.Tensor:
    """A private contiguous CPU copy of `t` (non-blocking into pinned memory when `pin`; the
    caller synchronises the device before the copy is read)."""
    t = t.detach()
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin and t.is_cuda)
    out.copy_(t, non_blocking=pin and t.is_cuda)
    return out


def _write_item(p: FlatPiece) -> WriteItem:
    offsets, sizes = torch.Size([p.start]), torch.Size([p.values.numel()])
    return WriteItem(
        index=MetadataIndex(p.fqn, offsets),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
            properties=TensorProperties.create_from_tensor(p.values),
            size=torch.Size([p.total]),
        ),
    )


class _PieceSavePlanner(DefaultSavePlanner):
    """One SHARD write item per local piece; data resolved from the pieces, not a state dict."""

    def __init__(self, pieces: list[FlatPiece]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.pieces = {(p.fqn, p.start): p for p in pieces if p.values.numel()}
        if len(self.pieces) != sum(1 for p in pieces if p.values.numel()):
            raise CheckpointError("two local pieces of one tensor start at the same element")

    def create_local_plan(self) -> SavePlan:
        self.plan = SavePlan([_write_item(p) for p in self.pieces.values()])
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
        values = self.pieces[(write_item.index.fqn, int(write_item.index.offset[0]))].values  # type: ignore[index]
        values = values.detach().to("cpu")
        # torch.save of a view would write its whole storage (e.g. a full flat buffer): copy it.
        whole = values.untyped_storage().nbytes() == values.numel() * values.element_size()
        return values if whole and values.is_contiguous() else values.clone()


def save_pieces(
    directory: Path, pieces: list[FlatPiece], meta: dict[str, Any] | None, group: Any = None
) -> None:
    """Collective over `group` (the default group when None): every rank passes the pieces it
    writes; rank 0 also writes `meta` as meta.json. Raises CheckpointError if the pieces of all
    ranks do not tile every tensor exactly once."""
    directory.mkdir(parents=True, exist_ok=True)
    rank = dist.get_rank() if dist.is_initialized() else 0
    writer = dcp.FileSystemWriter(str(directory), single_file_per_rank=True, sync_files=True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "assuming a single process" and the like
            dcp.save(
                {},
                storage_writer=writer,
                planner=_PieceSavePlanner(pieces),
                process_group=group,
                no_dist=not dist.is_initialized(),
            )
    except CheckpointException as exc:
        raise CheckpointError(f"saving sharded checkpoint {directory} failed: {exc}") from exc
    if rank == 0 and meta is not None:
        (directory / META).write_text(json.dumps({"format": FORMAT, **meta}, indent=2, sort_keys=True))


def is_dcp(directory: Path) -> bool:
    return (directory / DCP_METADATA).is_file()


class _CachedFileSystemReader(dcp.FileSystemReader):
    """Reads .metadata once (every load of a reader re-reads it otherwise)."""

    def __init__(self, path: Path, metadata: Metadata | None = None) -> None:
        super().__init__(str(path))
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._metadata is None:
            self._metadata = super().read_metadata(*args, **kwargs)
        return self._metadata


def read_dcp_metadata(directory: Path, storage: dcp.FileSystemReader | None = None) -> Metadata:
    """The `.metadata` of a DCP directory, checked before any tensor is read: present and
    unpicklable, and every shard file it names present and long enough for the byte ranges it
    records (a truncated shard). Else a CheckpointError naming the file."""
    path = directory / DCP_METADATA
    if not path.is_file():
        raise CheckpointError(f"{path}: missing ({directory} is not a sharded (DCP) checkpoint)")
    try:
        metadata = (storage or dcp.FileSystemReader(str(directory))).read_metadata()
    except UNREADABLE as exc:
        raise CheckpointError(f"{path}: cannot be read ({type(exc).__name__}: {exc})") from exc
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{path}: not DCP metadata (a {type(metadata).__name__})")
    needed: dict[str, int] = {}  # shard file -> bytes the metadata says it holds
    for info in (metadata.storage_data or {}).values():
        end = int(info.offset) + int(info.length)
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for fname, end in sorted(needed.items()):
        shard = directory / fname
        if not shard.is_file():
            raise CheckpointError(f"{shard}: missing shard file {fname} of sharded checkpoint {directory}")
        if shard.stat().st_size < end:
            raise CheckpointError(
                f"{shard}: truncated ({shard.stat().st_size} bytes, the metadata records {end})"
            )
    return metadata


class _RangeLoadPlanner(DefaultLoadPlanner):
    """Reads requested [start, end) ranges of flattened tensors into the given 1-D buffers."""

    def __init__(self, buffers: dict[tuple[str, int], torch.Tensor]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.buffers = buffers

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None  # set by DCP before planning
        items: list[ReadItem] = []
        for (fqn, start), buf in self.buffers.items():
            md = self.metadata.state_dict_metadata[fqn]
            chunk = ChunkStorageMetadata(offsets=torch.Size([start]), sizes=torch.Size([buf.numel()]))
            items += create_read_items_for_chunk_list(fqn, md, [chunk])  # type: ignore[arg-type]
        return LoadPlan(items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.buffers[(index.fqn, int(index.offset[0]))]  # type: ignore[index]


class DCPReader:
    """Ranges of the flattened tensors of a DCP directory written by `save_pieces`.

    `read(fqn, start, end)` loads that range, or a batch of announced ranges (`expect`) in one
    DCP load. A missing .metadata or shard file is a CheckpointError naming it."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._storage = _CachedFileSystemReader(directory)
        self.metadata = read_dcp_metadata(directory, self._storage)
        meta_path = directory / META
        self.meta: dict[str, Any] = read_json(meta_path) if meta_path.exists() else {}
        self._tensors = {
            k: v for k, v in self.metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)
        }
        self._cache: dict[Request, torch.Tensor] = {}
        self.expect([])

    def fqns(self) -> set[str]:
        return set(self._tensors)

    def master_numel(self, name: str) -> int | None:
        """numel of parameter `name`'s saved master copy (an optimizer checkpoint), None if absent."""
        fqn = f"{name}{SEP}{MASTER}"
        return self.numel(fqn) if fqn in self._tensors else None

    def numel(self, fqn: str) -> int:
        if fqn not in self._tensors:
            raise CheckpointError(f"checkpoint {self.directory} has no tensor {fqn!r}")
        return math.prod(self._tensors[fqn].size)

    def dtype(self, fqn: str) -> torch.dtype:
        self.numel(fqn)
        return self._tensors[fqn].properties.dtype

    def _check(self, fqn: str, start: int, end: int) -> None:
        n = self.numel(fqn)
        if not 0 <= start <= end <= n:
            raise CheckpointError(f"range [{start}, {end}) is outside tensor {fqn!r} of {n} elements")
        covered = sum(
            max(0, min(end, c.offsets[0] + c.sizes[0]) - max(start, c.offsets[0]))
            for c in self._tensors[fqn].chunks
        )
        if covered != end - start:
            raise CheckpointError(
                f"checkpoint {self.directory} covers {covered} of elements [{start}, {end}) of {fqn!r}"
            )

    def read_many(self, requests: Iterable[Request]) -> dict[Request, torch.Tensor]:
        """Every requested range in one DCP load (this rank only, no collectives)."""
        wanted = {r for r in requests if r[2] > r[1]}
        longest: dict[tuple[str, int], int] = {}
        for fqn, start, end in wanted:
            self._check(fqn, start, end)
            longest[(fqn, start)] = max(longest.get((fqn, start), 0), end)
        buffers = {(f, s): torch.empty(e - s, dtype=self.dtype(f)) for (f, s), e in longest.items()}
        if buffers:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", UserWarning)
                    dcp.load(
                        {}, storage_reader=self._storage, planner=_RangeLoadPlanner(buffers), no_dist=True
                    )
            except (CheckpointException, OSError, RuntimeError, KeyError) as exc:
                raise CheckpointError(f"reading sharded checkpoint {self.directory} failed: {exc}") from exc
        return {(f, s, e): buffers[(f, s)][: e - s] for f, s, e in wanted}

    def expect(self, requests: Iterable[Request], batch_bytes: int = 2**28) -> None:
        """Announce the ranges `read` will be asked for, in order: a miss then loads the next
        ranges of this list in one DCP load of at most `batch_bytes` (one request per load
        otherwise; DCP's per-load overhead is milliseconds)."""
        self._expected = [r for r in requests if r[2] > r[1]]
        self._position: dict[Request, int] = {}
        for i, r in enumerate(self._expected):
            self._position.setdefault(r, i)
        self._batch_bytes = batch_bytes

    def _fill_from(self, index: int) -> None:
        batch: list[Request] = []
        size = 0
        for r in self._expected[index:]:
            if r in self._cache:
                continue
            nbytes = (r[2] - r[1]) * self.dtype(r[0]).itemsize
            if batch and size + nbytes > self._batch_bytes:
                break
            batch.append(r)
            size += nbytes
        self._cache.update(self.read_many(batch))

    def read(self, fqn: str, start: int, end: int) -> torch.Tensor:
        """Elements [start, end) of flattened tensor `fqn` (in its saved dtype)."""
        key = (fqn, start, end)
        if key not in self._cache and key in self._position:
            self._fill_from(self._position[key])
        if key in self._cache:
            return self._cache.pop(key)
        if end == start:
            self._check(fqn, start, end)
            return torch.empty(0, dtype=self.dtype(fqn))
        return self.read_many([key])[key]


class DCPModelReader:
    """The `reader` of `Plugin.load_model_pieces` for a DCP model directory: names(), read(name,
    start, end) of flattened tensors, full(name) in its saved shape (shapes from meta.json)."""

    sharded = True

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.dcp = DCPReader(directory)
        shapes = self.dcp.meta.get("shapes", {})
        self.shapes = {n: tuple(shapes.get(n, [self.dcp.numel(n)])) for n in self.dcp.fqns()}

    def names(self) -> set[str]:
        return self.dcp.fqns()

    def read(self, name: str, start: int, end: int) -> torch.Tensor:
        return self.dcp.read(name, start, end)

    def full(self, name: str) -> torch.Tensor:
        return self.dcp.read(name, 0, self.dcp.numel(name)).view(self.shapes[name])


def iter_full_tensors(directory: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) of a DCP model directory, sorted by name, one tensor in memory at a time."""
    reader = DCPModelReader(directory)
    for name in sorted(reader.names()):
        yield name, reader.full(name)


__all__ = [
    "DCPModelReader",
    "DCPReader",
    "FlatPiece",
    "cpu_copy",
    "is_dcp",
    "iter_full_tensors",
    "save_pieces",
    "split_for_rank",
]
