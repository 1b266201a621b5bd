"""Weight synchronisation trainer -> rollout producers over a dedicated process group.

The consumer (trainer) ranks already form the default process group for ZeRO, so the weights
travel over a *separate* group of ``1 + num_producers`` members -- trainer rank 0 (member 0) and
every producer -- built directly on a loopback ``TCPStore`` (``ProcessGroupGloo`` on CPU,
``ProcessGroupNCCL`` on GPU), independent of ``torch.distributed``'s default group.

Protocol for one version: the parameters to send (all of them, or only the trainable ones for
LoRA) are visited in ``named_parameters()`` order, cast to ``wire_dtype`` and packed into flat
buckets of at most ``bucket_mb``. For each bucket member 0 broadcasts the data and then a header
``[numel, layout_hash, checksum]`` (int64); every receiver recomputes layout hash and checksum of
what it got and raises :class:`DistributedError` naming the bucket on a mismatch.
The checksum is exact: the bucket's bytes read as int32 words ``w_i``, ``sum_i w_i * (i mod 65521 + 1)``
in wrapping int64 arithmetic (order-independent, detects changed and permuted words).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from megalith.common.errors import ConfigError, DistributedError

_MODULUS = 65521


@dataclass(frozen=True)
class SyncGroupSpec:
    """Where and how the weight-sync group meets (member 0 hosts the store)."""

    port: int
    world_size: int
    host: str = "127.0.0.1"
    backend: str = "gloo"
    timeout_s: float = 300.0
    bucket_mb: float = 32.0
    wire_dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.world_size < 2:
            raise ConfigError(f"a weight-sync group needs >= 2 members, got {self.world_size}")
        if self.backend not in ("gloo", "nccl"):
            raise ConfigError(f"weight-sync backend must be 'gloo' or 'nccl', got {self.backend!r}")
        if self.bucket_mb <= 0:
            raise ConfigError(f"bucket_mb must be > 0, got {self.bucket_mb}")
        if self.wire_dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError(f"wire_dtype must be float32, bfloat16 or float16, got {self.wire_dtype!r}")


@dataclass(frozen=True)
class SyncStats:
    """What one synchronisation moved."""

    version: int
    num_tensors: int
    num_buckets: int
    num_bytes: int
    seconds: float
    checksums: tuple[int, ...]


class WeightSyncGroup:
    """One member of the trainer -> producers group (see module docstring)."""

    def __init__(self, spec: SyncGroupSpec, rank: int) -> None:
        if not 0 <= rank < spec.world_size:
            raise ConfigError(f"weight-sync rank {rank} outside 0..{spec.world_size - 1}")
        self.spec, self.rank = spec, rank
        timeout = timedelta(seconds=spec.timeout_s)
        self._store = dist.TCPStore(
            spec.host,
            spec.port,
            spec.world_size,
            is_master=rank == 0,
            timeout=timeout,
            wait_for_workers=False,
        )
        prefixed = dist.PrefixStore("megalith-weight-sync", self._store)
        self._pg: dist.ProcessGroupGloo | dist.ProcessGroupNCCL  # backends, not dist.ProcessGroup
        try:
            if spec.backend == "gloo":
                self._pg = dist.ProcessGroupGloo(prefixed, rank, spec.world_size, timeout)
            else:
                opts = dist.ProcessGroupNCCL.Options()
                opts._timeout = timeout
                self._pg = dist.ProcessGroupNCCL(prefixed, rank, spec.world_size, opts)
        except RuntimeError as exc:
            raise DistributedError(f"weight-sync group rank {rank} could not connect: {exc}") from exc
        self.device = torch.device("cuda", torch.cuda.current_device()) if spec.backend == "nccl" else None

    def broadcast(self, tensor: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        try:
            # torch's stubs give the C++ Backend no collectives (ProcessGroupGloo/NCCL have them)
            self._pg.broadcast([tensor], opts).wait()  # type: ignore[union-attr]
        except RuntimeError as exc:
            raise DistributedError(f"weight-sync broadcast failed on member {self.rank}: {exc}") from exc

    def close(self) -> None:
        shutdown = getattr(self._pg, "shutdown", None)
        if callable(shutdown):
            shutdown()


def sync_parameters(model: nn.Module, trainable_only: bool) -> list[tuple[str, torch.Tensor]]:
    """The tensors a sync moves, in a fixed order (tied weights appear once)."""
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad or not trainable_only]


def buckets(params: Sequence[tuple[str, torch.Tensor]], bucket_bytes: int, elem: int) -> Iterator[list[int]]:
    """Indices of consecutive tensors, at most ``bucket_bytes`` per bucket (one tensor may exceed it)."""
    current: list[int] = []
    size = 0
    for i, (_, t) in enumerate(params):
        nbytes = t.numel() * elem
        if current and size + nbytes > bucket_bytes:
            yield current
            current, size = [], 0
        current.append(i)
        size += nbytes
    if current:
        yield current


def checksum(flat: torch.Tensor) -> int:
    """Exact order-independent checksum of a flat tensor's bytes (see module docstring)."""
    raw = flat.detach().contiguous().view(-1).view(torch.uint8).cpu()
    if raw.numel() % 4:
        raw = torch.cat([raw, torch.zeros(4 - raw.numel() % 4, dtype=torch.uint8)])
    words = raw.view(torch.int32).long()
    weights = torch.arange(words.numel(), dtype=torch.long) % _MODULUS + 1
    return int((words * weights).sum())


def layout_hash(params: Sequence[tuple[str, torch.Tensor]], indices: Sequence[int]) -> int:
    text = ";".join(f"{params[i][0]}:{tuple(params[i][1].shape)}" for i in indices)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "big")


def _wire(spec: SyncGroupSpec) -> torch.dtype:
    return getattr(torch, spec.wire_dtype)


@torch.no_grad()
def send_weights(
    group: WeightSyncGroup,
    model: nn.Module,
    version: int,
    trainable_only: bool,
    params: Sequence[tuple[str, torch.Tensor]] | None = None,
) -> SyncStats:
    """Member 0: broadcast the model's parameters bucket by bucket, each followed by its header.

    ``params`` replaces ``sync_parameters(model, trainable_only)`` when the trainer's parameters
    are not the tensors the producers hold: the full tensors gathered from tensor-parallel blocks
    (``trainer.parallel.full_parameters``; same names, order and shapes as a plain model)."""
    start = time.perf_counter()
    params = list(params) if params is not None else sync_parameters(model, trainable_only)
    dtype = _wire(group.spec)
    elem = torch.empty((), dtype=dtype).element_size()
    sums, nbytes, count = [], 0, 0
    for count, idx in enumerate(buckets(params, int(group.spec.bucket_mb * 2**20), elem), start=1):  # noqa: B007
        flat = torch.cat([params[i][1].detach().reshape(-1).to(dtype) for i in idx])
        if group.device is not None:
            flat = flat.to(group.device)
        group.broadcast(flat)
        s = checksum(flat)
        header = torch.tensor([flat.numel(), layout_hash(params, idx), s], dtype=torch.long)
        group.broadcast(header.to(group.device) if group.device is not None else header)
        sums.append(s)
        nbytes += flat.numel() * elem
    return SyncStats(version, len(params), count, nbytes, time.perf_counter() - start, tuple(sums))


@dataclass(frozen=True)
class ReceivedWeights:
    """Verified buckets of one version, not yet copied into a model (``flats[k]`` holds bucket ``k``)."""

    stats: SyncStats
    bucket_indices: tuple[tuple[int, ...], ...]
    flats: tuple[torch.Tensor, ...]
    trainable_only: bool

    @torch.no_grad()
    def apply_to(self, model: nn.Module) -> None:
        params = sync_parameters(model, self.trainable_only)
        for idx, flat in zip(self.bucket_indices, self.flats):
            offset = 0
            for i in idx:
                p = params[i][1]
                p.copy_(flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()


@torch.no_grad()
def receive_weights(
    group: WeightSyncGroup, model: nn.Module, version: int, trainable_only: bool
) -> ReceivedWeights:
    """Producers: receive and verify every bucket into staging buffers (``.apply_to(model)`` copies them in).

    Staging lets a producer keep generating with its current weights while the next version
    arrives; only ``model``'s parameter names/shapes are read here.
    """
    start = time.perf_counter()
    params = sync_parameters(model, trainable_only)
    dtype = _wire(group.spec)
    elem = torch.empty((), dtype=dtype).element_size()
    sums, flats, layout = [], [], []
    for count, idx in enumerate(buckets(params, int(group.spec.bucket_mb * 2**20), elem), start=1):
        numel = sum(params[i][1].numel() for i in idx)
        flat = torch.empty(numel, dtype=dtype, device=group.device or "cpu")
        group.broadcast(flat)
        header = torch.zeros(3, dtype=torch.long, device=group.device or "cpu")
        group.broadcast(header)
        want = tuple(int(v) for v in header.cpu())
        got = (numel, layout_hash(params, idx), checksum(flat))
        if want != got:
            raise DistributedError(
                f"weight sync v{version}: bucket {count} (from {params[idx[0]][0]!r}) failed verification: "
                f"sent numel/layout/checksum {want}, received {got}"
            )
        sums.append(got[2])
        flats.append(flat)
        layout.append(tuple(idx))
    nbytes = sum(f.numel() for f in flats) * elem
    stats = SyncStats(version, len(params), len(flats), nbytes, time.perf_counter() - start, tuple(sums))
    return ReceivedWeights(stats, tuple(layout), tuple(flats), trainable_only)
