"""Checkpoints of tensor-parallel models in the formats every other layout reads.

Model: tp blocks are all-gathered into full tensors (`full_state_dict`, `full_model_pieces`), so
the HF safetensors directory is the one a single process would write; loading slices each full
tensor into this rank's block (`load_full_pieces`).

Optimizer: a row-parallel shard [out, in/tp] is not one range of the full flattened parameter, and a
rank's checkpoint file holds one range per parameter. So each parameter's state is assembled once,
in full, and written by one rank (parameter i by global rank i mod world): local pieces are summed
over dp (each dp rank fills only the elements it owns), all-gathered over tp and unsharded. Reading
slices the full range back into this rank's block (`ShardedPieceReader`). The result is an ordinary
piece checkpoint: ZeRO at any dp size, DDP or one process load it unchanged.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megalith.checkpoint import DCPReader, OptimPiece, PieceReader, unique_state
from megalith.checkpoint.optimizer_io import MASTER, SCALAR, SEP
from megalith.common.errors import CheckpointError
from megalith.optim import BoostedOptimizer
from megalith.tensor_parallel.comm import Group, group_size
from megalith.tensor_parallel.layers import ShardSpec, shard_spec


def gather_full(local: torch.Tensor, spec: ShardSpec, group: Group) -> torch.Tensor:
    """The full tensor from every rank's block (collective over the tp group)."""
    n = group_size(group)
    if n == 1:
        return spec.unshard([local])
    shards = [torch.empty_like(local) for _ in range(n)]
    dist.all_gather(shards, local.contiguous(), group=group)
    return spec.unshard(shards)


def full_state_dict(model: nn.Module, group: Group) -> dict[str, torch.Tensor]:
    """`model.state_dict()` with every tp-sharded tensor gathered to full size (on every tp rank).
    Tied parameters stay one tensor object, so they are written once."""
    out: dict[str, torch.Tensor] = {}
    cache: dict[int, torch.Tensor] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        spec = shard_spec(t)
        if spec is None:
            out[name] = t.detach()
            continue
        if id(t) not in cache:
            cache[id(t)] = gather_full(t.detach(), spec, group)
        out[name] = cache[id(t)]
    return out


def full_shapes(model: nn.Module) -> dict[str, tuple[list[int], str]]:
    """(full shape, dtype) per state-dict entry: a tp block reports the shape of the tensor it is a
    block of (unpadded), so a sharded checkpoint's meta.json describes the HF tensors."""
    out: dict[str, tuple[list[int], str]] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        spec = shard_spec(t)
        out[name] = (list(spec.full_shape if spec is not None else t.shape), str(t.dtype))
    return out


def full_model_pieces(
    model: nn.Module, group: Group, rank: int, world: int
) -> list[tuple[str, int, int, torch.Tensor]]:
    """(name, 0, numel, full flat values) of the tensors this rank writes in a sharded model save:
    tensor i (tied ones once) is gathered by its tp group and written by global rank i mod world."""
    out = []
    for index, (name, t) in enumerate(unique_state(model).items()):
        spec = shard_spec(t)
        full = gather_full(t.detach(), spec, group) if spec is not None else t.detach()
        if index % world == rank:
            out.append((name, 0, full.numel(), full.reshape(-1).clone()))
    return out


def load_full_pieces(model: nn.Module, reader: Any) -> None:
    """Fill a tp-sharded model from `reader.read(name, start, end)` ranges of full tensors (an HF
    directory or any sharded model checkpoint): each rank slices its blocks."""
    state = unique_state(model)
    missing = sorted(set(state) - reader.names())
    if missing:
        raise CheckpointError(f"checkpoint {reader.directory} has no tensor {missing[0]!r}")
    with torch.no_grad():
        for name, t in state.items():
            spec = shard_spec(t)
            shape = spec.full_shape if spec is not None else tuple(t.shape)
            full = reader.read(name, 0, math.prod(shape)).view(shape)
            t.copy_((spec.shard(full) if spec is not None else full).to(t.dtype))


def _elementwise_keys(opt: BoostedOptimizer) -> list[str]:
    keys: set[str] = set()
    for master, _ in opt.owned():
        for k, v in opt.optim.state.get(master, {}).items():
            if isinstance(v, torch.Tensor) and v.numel() == master.numel() and master.numel() > 1:
                keys.add(k)
    return sorted(keys)


def _local_state(opt: BoostedOptimizer, name: str, numel: int, keys: list[str]) -> torch.Tensor:
    """[len(keys), numel]: this rank's pieces of parameter `name` (zeros where it owns nothing)."""
    out = torch.zeros(len(keys), numel, dtype=torch.float32)
    for master, refs in opt.owned():
        state = opt.optim.state.get(master, {})
        sources = [master if k == MASTER else state.get(k) for k in keys]
        for ref in refs:
            if ref.name != name:
                continue
            n = ref.end - ref.start
            for row, src in enumerate(sources):
                if src is not None:
                    out[row, ref.start : ref.end] = (
                        src.detach().reshape(-1)[ref.offset : ref.offset + n].float().cpu()
                    )
    return out


def gather_optimizer_pieces(
    opt: BoostedOptimizer,
    params: dict[str, nn.Parameter],
    tp_group: Group,
    dp_group: Group,
    dp_sharded: bool,
    rank: int,
    world: int,
) -> list[OptimPiece]:
    """Every rank calls this; it returns the full-parameter pieces this rank writes."""
    keys = [*_elementwise_keys(opt), MASTER]
    pieces: list[OptimPiece] = []
    for index, (name, param) in enumerate(params.items()):
        local = _local_state(opt, name, param.numel(), keys)
        if dp_sharded and group_size(dp_group) > 1:
            dist.all_reduce(local, group=dp_group)
        spec = shard_spec(param)
        if spec is not None:
            stacked = local.view(len(keys), *param.shape)
            n = group_size(tp_group)
            shards = [torch.empty_like(stacked) for _ in range(n)]
            if n > 1:
                dist.all_gather(shards, stacked, group=tp_group)
            else:
                shards = [stacked]
            full = torch.stack([spec.unshard([s[i] for s in shards]) for i in range(len(keys))])
            local = full.view(len(keys), -1)
        if index % world == rank:
            tensors = {k: local[i].clone() for i, k in enumerate(keys)}
            pieces.append(OptimPiece(name, 0, local.shape[1], tensors))
    return pieces


class ShardedPieceReader(PieceReader):
    """A `PieceReader` whose ranges are in this rank's *local* (tp-block) coordinates: the full
    parameter is read once and sliced with its `ShardSpec`."""

    def __init__(self, directory: Path, params: dict[str, nn.Parameter]) -> None:
        super().__init__(directory)
        self._specs = {name: spec for name, p in params.items() if (spec := shard_spec(p)) is not None}
        self._cache: tuple[str, str, torch.Tensor] | None = None

    def read(self, name: str, key: str, start: int, end: int) -> torch.Tensor:
        spec = self._specs.get(name)
        if spec is None:
            return super().read(name, key, start, end)
        if self._cache is None or self._cache[:2] != (name, key):
            full = super().read(name, key, 0, math.prod(spec.full_shape)).view(spec.full_shape)
            self._cache = (name, key, spec.shard(full).reshape(-1))
        return self._cache[2][start:end]


class ShardedDCPReader(DCPReader):
    """A `DCPReader` of an optimizer checkpoint (tensors ``name::key`` of flattened *full*
    parameters, as every other plugin writes them) whose ranges are in this rank's local
    (tp-block) coordinates for tensor-parallel parameters: each full tensor is read once (one at a
    time, never the whole model) and sliced with its `ShardSpec`; other tensors pass through."""

    KEEP = 4  # full tensors kept at once (the states of one master are read together)

    def __init__(self, directory: Path, params: dict[str, nn.Parameter]) -> None:
        self._specs = {name: spec for name, p in params.items() if (spec := shard_spec(p)) is not None}
        self._blocks: dict[str, torch.Tensor] = {}
        super().__init__(directory)

    def _spec(self, fqn: str) -> ShardSpec | None:
        name, _, key = fqn.partition(SEP)
        return None if key.startswith(SCALAR) else self._specs.get(name)

    def expect(self, requests: Any, batch_bytes: int = 2**28) -> None:
        """Announce the full tensors behind the local ranges (each once, in first-use order)."""
        full: dict[tuple[str, int, int], None] = {}
        for fqn, start, end in requests:
            spec = self._spec(fqn)
            full[(fqn, start, end) if spec is None else (fqn, 0, math.prod(spec.full_shape))] = None
        super().expect(full, batch_bytes)

    def read(self, fqn: str, start: int, end: int) -> torch.Tensor:
        spec = self._spec(fqn)
        if spec is None:
            return super().read(fqn, start, end)
        if fqn not in self._blocks:
            whole = super().read(fqn, 0, math.prod(spec.full_shape)).view(spec.full_shape)
            self._blocks[fqn] = spec.shard(whole).reshape(-1)
            while len(self._blocks) > self.KEEP:
                self._blocks.pop(next(iter(self._blocks)))
        return self._blocks[fqn][start:end]
