"""Point-to-point transfers of activations and gradients between pipeline ranks.

A *channel* is one direction of one stage boundary: ("F", s) carries stage s's activations to stage
s+1, ("B", s) carries the gradient of stage s's input to stage s−1. Every channel has its own tag
pair (metadata, data), so messages of different channels between the same two ranks can never be
matched with each other, whatever the order the schedule posts them in.

The first message of a channel in a step is preceded by its metadata — a fixed int64 tensor
`[dtype code, ndim, d0 … d5]` — which the receiver caches to allocate the following buffers. Sends
are non-blocking (`batch_isend_irecv`; their handles are waited in `finish`), receives block, so a
schedule that is deadlock-free with buffered sends (what the simulator checks) runs as written.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megalith.common.errors import ConfigError, DistributedError

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32)
_META_LEN = 8
Channel = tuple[str, int]


@dataclass(frozen=True)
class Send:
    tensor: torch.Tensor
    peer: int  # rank in the pipeline group
    channel: Channel


@dataclass(frozen=True)
class Recv:
    peer: int
    channel: Channel


def _tags(channel: Channel) -> tuple[int, int]:
    kind, stage = channel
    base = 2 * (2 * stage + (0 if kind == "F" else 1))
    return base, base + 1


def _meta(t: torch.Tensor) -> torch.Tensor:
    if t.dtype not in _DTYPES or t.dim() > _META_LEN - 2:
        raise ConfigError(f"cannot send a {t.dtype} tensor of shape {tuple(t.shape)} between pipeline stages")
    meta = torch.zeros(_META_LEN, dtype=torch.int64)
    meta[0], meta[1] = _DTYPES.index(t.dtype), t.dim()
    meta[2 : 2 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
    return meta


class PipeP2P:
    """Send / receive over the pipeline group `group` (peers are ranks *in* that group)."""

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device | None = None) -> None:
        self.group = group
        self.device = device or torch.device("cpu")
        self._meta_sent: set[Channel] = set()
        self._shapes: dict[Channel, tuple[torch.dtype, tuple[int, ...]]] = {}
        self._pending: list[tuple[dist.Work, torch.Tensor]] = []

    def _global(self, peer: int) -> int:
        return dist.get_global_rank(self.group, peer) if self.group is not None else peer

    def _op(self, fn: object, t: torch.Tensor, peer: int, tag: int) -> dist.P2POp:
        return dist.P2POp(fn, t, self._global(peer), self.group, tag)  # type: ignore[arg-type]

    def exchange(self, sends: list[Send], recvs: list[Recv]) -> list[torch.Tensor]:
        """Post `sends` (non-blocking) and return the received tensors in `recvs` order."""
        ops: list[dist.P2POp] = []
        keep: list[torch.Tensor] = []
        for s in sends:
            meta_tag, data_tag = _tags(s.channel)
            data = s.tensor.detach().contiguous()
            if s.channel not in self._meta_sent:
                meta = _meta(data).to(self.device)
                ops.append(self._op(dist.isend, meta, s.peer, meta_tag))
                keep.append(meta)
                self._meta_sent.add(s.channel)
            ops.append(self._op(dist.isend, data, s.peer, data_tag))
            keep.append(data)
        if ops:
            works = dist.batch_isend_irecv(ops)
            self._pending.extend(zip(works, keep, strict=True))
        self._learn_shapes([r for r in recvs if r.channel not in self._shapes])
        buffers = []
        ops = []
        for r in recvs:
            dtype, shape = self._shapes[r.channel]
            buf = torch.empty(shape, dtype=dtype, device=self.device)
            ops.append(self._op(dist.irecv, buf, r.peer, _tags(r.channel)[1]))
            buffers.append(buf)
        self._wait(dist.batch_isend_irecv(ops) if ops else [])
        return buffers

    def _learn_shapes(self, recvs: list[Recv]) -> None:
        if not recvs:
            return
        metas = [torch.zeros(_META_LEN, dtype=torch.int64, device=self.device) for _ in recvs]
        ops = [
            self._op(dist.irecv, m, r.peer, _tags(r.channel)[0]) for m, r in zip(metas, recvs, strict=True)
        ]
        self._wait(dist.batch_isend_irecv(ops))
        for meta, r in zip(metas, recvs, strict=True):
            meta = meta.cpu()
            ndim = int(meta[1])
            self._shapes[r.channel] = (_DTYPES[int(meta[0])], tuple(int(d) for d in meta[2 : 2 + ndim]))

    @staticmethod
    def _wait(works: list[dist.Work]) -> None:
        for w in works:
            if w is not None and not w.wait():
                raise DistributedError("a pipeline receive failed")

    def finish(self) -> None:
        """Wait for every send of the step and forget the shapes (the next step may differ)."""
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()
        self._meta_sent.clear()
        self._shapes.clear()
