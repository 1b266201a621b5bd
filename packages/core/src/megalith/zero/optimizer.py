"""The ZeRO-1/2 optimizer: fp32 master weights and optimizer states sharded over dp.

Per step, for every bucket (see `buckets.py`):
    grads  --reduce-scatter(sum)/dp-->  this rank's gradient shard     [S]
    master shard  --optimizer.step-->   updated master shard           [S]   (fp32; host if offloaded)
    shard  --all-gather-->              full flat parameters           [padded]
Stage 1 keeps full gradients (p.grad are views of one flat buffer per bucket); stage 2 keeps only the
gradient shard and frees p.grad as soon as its bucket is reduced.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megalith.distributed import all_gather_flat, comm_device, reduce_scatter_flat
from megalith.optim import BoostedOptimizer, DynamicLossScaler, PieceRef, prefer_fused
from megalith.zero.buckets import FlatBucket, make_buckets
from megalith.zero.config import ZeroConfig


class _Pending:
    """An in-flight reduce-scatter of one bucket."""

    def __init__(self, bucket: FlatBucket, out: torch.Tensor, work: Any) -> None:
        self.bucket, self.out, self.work = bucket, out, work


class ZeroOptimizer(BoostedOptimizer):
    sharded_grads = True

    def __init__(
        self,
        optim: torch.optim.Optimizer,
        named_params: dict[nn.Parameter, str],
        config: ZeroConfig,
        dp_group: dist.ProcessGroup | None = None,
        scaler: DynamicLossScaler | None = None,
        master_dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__(optim, scaler)
        self.config = config
        self.norm_group = dp_group
        self.dp_group = dp_group
        self.dp_size = dist.get_world_size(dp_group) if dist.is_initialized() else 1
        self.dp_rank = dist.get_rank(dp_group) if dist.is_initialized() else 0
        self.buckets: list[FlatBucket] = []
        self.masters: list[torch.Tensor] = []
        self._bucket_of: dict[int, int] = {}
        self._pending: list[_Pending] = []
        self._next_launch = 0
        self._hooks: list[Any] = []
        self._got_grad: set[int] = set()
        self._grads_written = True  # the gradient shards hold this step's values (zeros at first)
        self.overlap = config.overlap_communication
        first = next((p for g in optim.param_groups for p in g["params"]), None)
        if self.overlap is None:
            self.overlap = first is not None and first.device.type == "cuda"
        for group in optim.param_groups:
            params = [(named_params[p], p) for p in group["params"] if p.requires_grad]
            # Reverse registration order ≈ the order backward produces gradients.
            element = params[0][1].element_size() if params else 4
            buckets = make_buckets(params[::-1], config.bucket_numel(element), self.dp_size, self.dp_rank)
            group["params"] = [self._add_bucket(b, master_dtype) for b in buckets]
        if config.cpu_offload and first is not None and first.device.type != "cpu":
            prefer_fused(optim)  # the update runs on the host: one fused pass, not ten
        self._register_hooks()

    # -- construction ---------------------------------------------------------------------------
    def _add_bucket(self, bucket: FlatBucket, master_dtype: torch.dtype) -> torch.Tensor:
        index = len(self.buckets)
        self.buckets.append(bucket)
        for slot in bucket:
            self._bucket_of[id(slot.param)] = index
        if self.config.stage == 1:
            bucket.grad_flat = torch.zeros_like(bucket.flat)  # type: ignore[attr-defined]
            lo, hi = bucket.shard_range
            bucket.grad_shard = bucket.grad_flat[lo:hi]  # type: ignore[attr-defined]
            self._point_grads_at_flat(bucket)
        else:
            bucket.grad_shard = torch.zeros(bucket.shard_numel, dtype=bucket.dtype, device=bucket.device)  # type: ignore[attr-defined]
        if bucket.dtype == master_dtype and not self.config.cpu_offload:
            master = bucket.shard  # the parameter shard itself is the master: no copy
        else:
            device = torch.device("cpu") if self.config.cpu_offload else bucket.device
            master = bucket.shard.detach().to(device=device, dtype=master_dtype).clone()
            if self.config.cpu_offload and bucket.device.type == "cuda":
                master = master.pin_memory()
        self.masters.append(master)
        return master

    @staticmethod
    def _point_grads_at_flat(bucket: FlatBucket) -> None:
        for s in bucket:
            view = bucket.grad_flat[s.offset : s.offset + s.numel].view_as(s.param)  # type: ignore[attr-defined]
            if s.param.grad is not None and s.param.grad.data_ptr() != view.data_ptr():
                view.copy_(s.param.grad)
            elif s.param.grad is None:
                view.zero_()
            s.param.grad = view

    def _register_hooks(self) -> None:
        for bucket in self.buckets:
            for slot in bucket:
                self._hooks.append(slot.param.register_post_accumulate_grad_hook(self._on_grad))

    # -- gradient reduction -----------------------------------------------------------------------
    def _on_grad(self, param: torch.Tensor) -> None:
        self._got_grad.add(id(param))
        if not self.sync_gradients or not self.overlap:
            return
        index = self._bucket_of[id(param)]
        bucket = self.buckets[index]
        bucket.ready.add(id(param))
        while self._next_launch < len(self.buckets):
            nxt = self.buckets[self._next_launch]
            if len(nxt.ready) < len(nxt.slots):
                break
            self._launch(nxt, async_op=True)

    def _launch(self, bucket: FlatBucket, async_op: bool) -> None:
        """Reduce-scatter one bucket's gradients (launches must happen in bucket order on every rank).

        Stage 2 reduces straight into the bucket's gradient shard; with one rank the shard is the
        whole bucket and the gradients are packed into it (one copy, nothing to reduce). Stage 1
        reduces into a scratch shard (its own shard aliases the input), except on one rank, where
        the flat gradient buffer already is the shard.

        Accumulation without `no_sync` (a later synchronised backward of the same step): stage 2
        freed `p.grad` at the first reduction, so the new gradients are clean; they are reduced into
        a scratch shard and added to the shard (g ← g + Σ_r g'_r / dp). Stage 1 set the reduced
        shard aside and zeroed the flat buffer before that backward (`_before_backward`).
        """
        self._next_launch += 1
        shard = bucket.grad_shard  # type: ignore[attr-defined]
        accumulate = bucket.reduced
        bucket.reduced = True
        self._grads_written = True
        if self.config.stage == 1:
            self._point_grads_at_flat(bucket)
            if self.dp_size == 1:
                return
            flat = bucket.grad_flat  # type: ignore[attr-defined]
            out = torch.empty_like(shard)
        else:
            if self.dp_size == 1:
                if accumulate:
                    shard.add_(bucket.flat_grads())
                else:
                    bucket.flat_grads(shard)
            else:
                flat = bucket.flat_grads()
            for s in bucket:
                s.param.grad = None  # stage 2 keeps only the shard
            if self.dp_size == 1:
                return
            out = torch.empty_like(shard) if accumulate else shard
        # On gloo `flat` is scratch afterwards: under stage 1 the p.grad views of other ranks'
        # chunks hold partial sums, which is why the reduced shard is read from `out` only.
        work = reduce_scatter_flat(out, flat, group=self.dp_group, async_op=async_op)
        self._pending.append(_Pending(bucket, out, work))

    def _before_backward(self) -> None:
        """Stage 1 with dp > 1, a backward after this step's reduction: the flat gradient buffer is
        reduce-scatter scratch (own chunk = the reduced shard, the rest partial sums), so keep the
        reduced shard aside (`carry`, added back after the next reduction) and zero the buffer; the
        next reduction then sums only new local gradients. Nothing happens on the common path of
        one synchronised backward per step."""
        if self.config.stage != 1 or self.dp_size == 1:
            return
        for bucket in self.buckets:
            if bucket.reduced:
                bucket.carry = bucket.grad_shard.clone()  # type: ignore[attr-defined]
                bucket.grad_flat.zero_()  # type: ignore[attr-defined]
                bucket.reduced = False

    def _finish_backward(self) -> None:
        while self._next_launch < len(self.buckets):
            self._launch(self.buckets[self._next_launch], async_op=False)
        for pending in self._pending:
            if pending.work is not None:
                pending.work.wait()
            pending.out.div_(self.dp_size)
            bucket = pending.bucket
            shard = bucket.grad_shard  # type: ignore[attr-defined]
            if pending.out is not shard:
                if self.config.stage == 2:
                    shard.add_(pending.out)  # a later reduction of this step accumulates
                else:
                    shard.copy_(pending.out)
            self._add_carry(bucket)
            bucket.ready.clear()
        self._pending.clear()
        self._next_launch = 0

    @staticmethod
    def _add_carry(bucket: FlatBucket) -> None:
        if bucket.carry is not None:
            bucket.grad_shard.add_(bucket.carry)  # type: ignore[attr-defined]
            bucket.carry = None

    # -- step -------------------------------------------------------------------------------------
    def _master_grads(self) -> list[torch.Tensor]:
        if not self._grads_written:  # a step with no backward since zero_grad: zero gradients
            for bucket in self.buckets:
                bucket.grad_shard.zero_()  # type: ignore[attr-defined]
            self._grads_written = True
        for bucket in self.buckets:  # a backward after the reduction but none synchronised since
            self._add_carry(bucket)
        if not self._prepared:
            for bucket, master in zip(self.buckets, self.masters, strict=True):
                grad = bucket.grad_shard  # type: ignore[attr-defined]
                master.grad = grad if master is bucket.shard else grad.to(master.device, master.dtype)
        return [m.grad for m in self.masters if m.grad is not None]

    def _publish_params(self) -> None:
        works: list[Any] = []
        with torch.no_grad():
            for bucket, master in zip(self.buckets, self.masters, strict=True):
                if master is not bucket.shard:
                    bucket.shard.copy_(master, non_blocking=True)
                if self.dp_size > 1:
                    works.append(all_gather_flat(bucket.flat, group=self.dp_group, async_op=True))
        for w in works:
            w.wait()

    def _before_inner_step(self) -> Any:
        """Parameters that got no gradient on any rank must not move (as with a plain torch optimizer,
        which skips `grad is None`): stash their master and state pieces to restore after the step."""
        slots = [s for b in self.buckets for s in b]
        got = [id(s.param) in self._got_grad for s in slots]
        if dist.is_initialized() and self.dp_size > 1:
            flags = torch.tensor(got, dtype=torch.uint8, device=comm_device(self.dp_group))
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.dp_group)
            got = [bool(f) for f in flags.tolist()]
        unused = {s.name for s, f in zip(slots, got, strict=True) if not f}
        return self._stash_pieces(unused)

    def _after_inner_step(self, stash: Any) -> None:
        self._restore_pieces(stash)

    def _zero_grad(self) -> None:
        """Stage 1 zeroes the flat buffers the gradients accumulate in; stage 2's shards are
        overwritten whole by the step's first reduction (or zeroed by a step that comes before one)."""
        self._got_grad.clear()
        self._grads_written = self.config.stage == 1
        for bucket, master in zip(self.buckets, self.masters, strict=True):
            bucket.reduced, bucket.carry = False, None
            if self.config.stage == 1:
                bucket.grad_flat.zero_()  # type: ignore[attr-defined]
            master.grad = None
            if self.config.stage == 2:
                for s in bucket:
                    s.param.grad = None

    # -- state for checkpoints and memory accounting ---------------------------------------------
    replicated = False

    def owned(self) -> list[tuple[torch.Tensor, list[PieceRef]]]:
        return [(m, b.pieces()) for b, m in zip(self.buckets, self.masters, strict=True)]

    def param_numels(self) -> dict[str, int]:
        return {s.name: s.numel for b in self.buckets for s in b}

    def master_names(self) -> dict[int, list[str]]:
        return {id(m): [s.name for s in b] for b, m in zip(self.buckets, self.masters, strict=True)}

    def _after_master_load(self) -> None:
        self._publish_params()

    def load_masters_from_model(self) -> None:
        """After new weights were loaded into the model's parameters, refresh the masters."""
        with torch.no_grad():
            for bucket, master in zip(self.buckets, self.masters, strict=True):
                if master is not bucket.shard:
                    master.copy_(bucket.shard)

    def memory_bytes(self) -> dict[str, int]:
        """Bytes this rank holds for gradients and optimizer states (including separate fp32 masters)."""
        grads = sum(
            (b.grad_flat if self.config.stage == 1 else b.grad_shard).numel() * b.dtype.itemsize  # type: ignore[attr-defined]
            for b in self.buckets
        )
        states = sum(
            t.numel() * t.element_size()
            for m in self.masters
            for t in self.optim.state.get(m, {}).values()
            if isinstance(t, torch.Tensor) and t.numel() > 1
        )
        masters = sum(
            m.numel() * m.element_size()
            for b, m in zip(self.buckets, self.masters, strict=True)
            if m is not b.shard
        )
        return {"grads": grads, "optimizer_states": states + masters}


def named_parameter_map(model: nn.Module) -> dict[nn.Parameter, str]:
    """Parameter → its first name (tied parameters appear once, under the first name)."""
    out: dict[nn.Parameter, str] = {}
    for name, p in model.named_parameters():
        out.setdefault(p, name)
    return out
