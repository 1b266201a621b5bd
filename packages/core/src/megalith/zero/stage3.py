"""ZeRO-3 runtime: parameters live as 1/N shards and are all-gathered per unit just in time.

Per unit (see `stage3_layout.py`) and step, on every dp rank:
    forward   pre-hook:  all-gather the unit's segments   shard [S] → flat [N·S]   (prefetch: next unit)
              post-hook: free the flat storage; hook the outputs so backward gathers again
    backward  output-grad hook: all-gather again (prefetch: next unit in reverse execution order)
              param grad hooks: p.grad → the segment's flat gradient buffer (p.grad freed at once);
              once every trainable parameter of the unit has its gradient: reduce-scatter the buffer
              (sum / N) into the fp32 gradient shard, free the parameters
    end of backward (autograd callback): reduce units some rank saw gradients for but that did not
              complete (unused parameters), free everything still gathered
Per step that is 3 passes of (N-1)/N·Ψ elements per rank (gather, gather, reduce-scatter) against
DDP's 2 (all-reduce) — the ZeRO paper's 1.5×. Under `no_sync` gradients accumulate in the flat
buffers (full size, as FSDP's no_sync) and the next synchronised backward reduces them.

Collectives are issued in execution order, which is the same on every rank for the same graph;
a model whose set of used modules differs between ranks is not supported.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megalith.distributed import Handle, all_gather_flat, comm_device, reduce_scatter_flat
from megalith.zero.stage3_layout import FROZEN, Segment, Slot, Unit, alloc_storage, free_storage

logger = logging.getLogger(__name__)


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside a module output (tensors, tuples/lists, dicts and HF ModelOutputs)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, tuple | list):
        for x in obj:
            yield from _tensors(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _tensors(x)


def _accumulate(seg: Segment, part: torch.Tensor, dp_size: int) -> None:
    """grad shard += part / N; the first reduction after zero_grad writes it instead (one pass,
    with the fp32 conversion fused in). An offloaded shard (pinned host memory) is written by an
    asynchronous device-to-host copy that overlaps the rest of backward: whoever reads it on the
    host first synchronises (`Zero3Optimizer._master_grads`)."""
    dst = seg.grad_shard  # type: ignore[attr-defined]
    if seg.grad_fresh and dst.device != part.device:
        src = part.float().div_(dp_size) if dp_size > 1 else part
        dst.copy_(src, non_blocking=dst.is_pinned())
    elif seg.grad_fresh:
        dst.copy_(part)
        if dp_size > 1:
            dst.div_(dp_size)
    else:
        dst.add_(part.to(dst.device, dst.dtype).div_(dp_size))
    seg.grad_fresh = False


class ParamSharder:
    def __init__(
        self,
        units: list[Unit],
        dp_group: dist.ProcessGroup | None,
        overlap: bool,
        prefetch: bool,
    ) -> None:
        self.units = units
        self.dp_group = dp_group
        self.dp_size = dist.get_world_size(dp_group) if dist.is_initialized() else 1
        self.overlap, self.prefetch = overlap, prefetch
        self.sync = True  # False under no_sync: keep accumulating full gradients locally
        self.got_grad: set[str] = set()  # names of parameters that received a gradient since zero_grad
        self._fired: dict[int, set[int]] = {}
        self._reduced: set[int] = set()
        self._inflight: dict[int, list[Handle]] = {}
        self._pending: list[tuple[Segment, torch.Tensor, torch.Tensor, Handle | None]] = []
        self._fwd_order: list[int] = []
        self._post_order: list[int] = []
        self._recorded = False
        self._callback_queued = False
        self._hooks: list[Any] = []
        for unit in units:
            self._hooks.append(unit.module.register_forward_pre_hook(partial(self._pre_forward, unit)))
            self._hooks.append(unit.module.register_forward_hook(partial(self._post_forward, unit)))
            for seg in unit.segments:
                for slot in seg.slots:
                    if slot.param.requires_grad:
                        hook = partial(self._on_grad, unit, seg, slot)
                        self._hooks.append(slot.param.register_post_accumulate_grad_hook(hook))

    # -- gather / free ------------------------------------------------------------------------------
    def gather(self, unit: Unit, async_op: bool = False) -> None:
        """flat ← all-gather of every rank's shard (a no-op when gathered; waits for a prefetch)."""
        if unit.index in self._inflight:
            if not async_op:
                for h in self._inflight.pop(unit.index):
                    h.wait()
            return
        if all(seg.is_gathered for seg in unit.segments):
            return
        handles = []
        for seg in unit.segments:
            alloc_storage(seg.flat)
            lo, hi = seg.shard_range
            seg.flat[lo:hi].copy_(seg.shard, non_blocking=seg.shard.is_pinned())
            if self.dp_size > 1:
                handles.append(all_gather_flat(seg.flat, group=self.dp_group, async_op=True))
        if async_op:
            self._inflight[unit.index] = handles
        else:
            for h in handles:
                h.wait()

    def release(self, unit: Unit) -> None:
        for h in self._inflight.pop(unit.index, []):
            h.wait()
        for seg in unit.segments:
            free_storage(seg.flat)

    def release_all(self) -> None:
        for unit in self.units:
            self.release(unit)

    @contextmanager
    def gathered(self) -> Iterator[None]:
        """Every parameter full on every rank inside the block (a collective; for export and tests)."""
        for unit in self.units:
            self.gather(unit)
        try:
            yield
        finally:
            self.release_all()

    def _prefetch_after(self, unit: Unit, order: list[int]) -> None:
        if not (self.prefetch and self._recorded):
            return
        try:
            nxt = order.index(unit.index) + 1
        except ValueError:
            return
        if nxt < len(order):
            self.gather(self.units[order[nxt]], async_op=True)

    # -- forward ---------------------------------------------------------------------------------------
    def _pre_forward(self, unit: Unit, module: nn.Module, args: Any) -> None:
        if not self._recorded and unit.index not in self._fwd_order:
            self._fwd_order.append(unit.index)
        self.gather(unit)
        self._prefetch_after(unit, self._fwd_order)

    def _post_forward(self, unit: Unit, module: nn.Module, args: Any, output: Any) -> None:
        if not self._recorded:
            if unit.index not in self._post_order:
                self._post_order.append(unit.index)
            if unit is self.units[-1]:  # the root finished its first forward
                self._recorded = True
                self._post_order.reverse()  # ≈ the order backward reaches the units
        if torch.is_grad_enabled():
            for t in _tensors(output):
                if t.requires_grad:
                    t.register_hook(partial(self._pre_backward, unit))
        self.release(unit)

    # -- backward --------------------------------------------------------------------------------------
    def _pre_backward(self, unit: Unit, grad: torch.Tensor) -> None:
        self._queue_callback()
        self.gather(unit)
        self._prefetch_after(unit, self._post_order)

    def _queue_callback(self) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _on_grad(self, unit: Unit, seg: Segment, slot: Slot, param: torch.Tensor) -> None:
        self._queue_callback()
        grad = param.grad
        param.grad = None  # the full-size gradient lives only in the flat buffer
        if grad is None or seg.key == FROZEN:
            return
        if seg.grad_acc is None:
            seg.grad_acc = torch.zeros(seg.padded_numel, dtype=seg.dtype, device=seg.flat.device)
        seg.grad_acc[slot.offset : slot.offset + slot.numel].add_(grad.reshape(-1))
        self.got_grad.add(slot.name)
        fired = self._fired.setdefault(unit.index, set())
        fired.add(id(param))
        if self.sync and len(fired) == len(unit.trainable) and unit.index not in self._reduced:
            self._reduce(unit)
            if not unit.has_frozen:
                self.release(unit)

    def _reduce(self, unit: Unit) -> None:
        """grad shard += reduce-scatter(flat grads) / N for every trainable segment of the unit."""
        self._reduced.add(unit.index)
        issued = len(self._pending)
        for seg in unit.segments:
            if seg.key == FROZEN:
                continue
            acc = seg.grad_acc
            if acc is None:
                acc = torch.zeros(seg.padded_numel, dtype=seg.dtype, device=seg.flat.device)
            seg.grad_acc = None
            out, handle = acc, None  # one rank: the local sum is the shard
            if self.dp_size > 1:
                out = torch.empty(seg.shard_numel, dtype=seg.dtype, device=acc.device)
                handle = reduce_scatter_flat(out, acc, group=self.dp_group, async_op=self.overlap)
            self._pending.append((seg, out, acc, handle))
        if not self.overlap or self.dp_size == 1:  # nothing in flight to wait for: write the shard now
            self.finish_reductions()
        else:  # keep one unit's reduction in flight: older buffers are freed as backward goes on
            self.finish_reductions(keep=len(self._pending) - issued)

    def finish_reductions(self, keep: int = 0) -> None:
        """Wait for and apply the pending reductions but the newest `keep` (issued in order)."""
        done = len(self._pending) - keep
        for seg, out, _, handle in self._pending[:done]:
            if handle is not None:
                handle.wait()
            _accumulate(seg, out, self.dp_size)
        del self._pending[:done]

    def _end_of_backward(self) -> None:
        self._callback_queued = False
        if self.sync:
            self._flush_incomplete()
            self.finish_reductions()
        self._fired.clear()  # completion counts are per backward; no_sync sums live in grad_acc
        self._reduced.clear()
        self.release_all()

    def _flush_incomplete(self) -> None:
        """Reduce the units any rank saw a gradient for but that did not complete (same set everywhere)."""
        todo = [
            float(u.index not in self._reduced and any(s.grad_acc is not None for s in u.segments))
            for u in self.units
        ]
        flags = torch.tensor(todo, dtype=torch.float32, device=comm_device(self.dp_group))
        if self.dp_size > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.dp_group)
        for unit, flag in zip(self.units, flags.tolist(), strict=True):
            if flag > 0 and unit.index not in self._reduced:
                self._reduce(unit)

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
