"""Optimizer wrappers of `HybridPlugin`: gradients summed over tp where partial, reduced over dp
(all-reduce or ZeRO), the global norm over the 2-D mesh, and piece-checkpoint loading in tp-block
coordinates."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn

from megalith.booster.optim_state import MASTER, _load_master_state, check_optimizer_meta
from megalith.checkpoint import PieceReader
from megalith.common.errors import CheckpointError
from megalith.optim import BoostedOptimizer, DynamicLossScaler, ReplicatedOptimizer, clip_grads_
from megalith.tensor_parallel import TensorParallelInfo
from megalith.zero import ZeroConfig, ZeroOptimizer

Group = dist.ProcessGroup | None


def _sum_over(grads: list[torch.Tensor], group: Group, scale: float = 1.0) -> None:
    """In-place Σ over `group` (times `scale`) of several gradients, as one flat all-reduce."""
    if not grads or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    if scale != 1.0:
        flat.mul_(scale)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def tp_grad_sq(
    opt: BoostedOptimizer, info: TensorParallelInfo, skip: frozenset[str] = frozenset()
) -> torch.Tensor:
    """This rank's Σ g² (fp64): tp-sharded pieces on every tp rank, replicated pieces on tp rank 0
    only; pieces named in `skip` (e.g. a tied copy counted elsewhere) are left out."""
    tp_rank = dist.get_rank(info.group) if info.size > 1 else 0
    local = torch.zeros((), dtype=torch.float64)
    for master, refs in opt.owned():
        if master.grad is None:
            continue
        flat = master.grad.detach().reshape(-1)
        for ref in refs:
            if ref.name not in skip and (ref.name in info.sharded or tp_rank == 0):
                local += flat[ref.offset : ref.offset + ref.end - ref.start].double().pow(2).sum().cpu()
    return local


def tp_grad_norm(opt: BoostedOptimizer, info: TensorParallelInfo, group: Group) -> float:
    """‖g‖₂ over every rank of `group`: `tp_grad_sq` summed there."""
    local = tp_grad_sq(opt, info)
    if dist.is_initialized():
        dist.all_reduce(local, group=group)
    return math.sqrt(float(local))


class _LocalPieces:
    """Guard for the booster's generic optimizer checkpoint path, which needs `owned()` ranges of
    the full flattened parameters: at tp > 1 ours are ranges of the local blocks, so that path raises
    instead of writing or reading wrong state (`HybridPlugin.save_optimizer` / `load_optimizer`)."""

    info: TensorParallelInfo
    _local_loads = False

    def param_numels(self) -> dict[str, int]:
        """Pieces are of tp-local blocks: the tensor-parallel loaders check full shapes instead."""
        return {}

    def _check_generic_path(self) -> None:
        if self.info.size > 1 and not self._local_loads:
            raise CheckpointError(
                "a tensor-parallel optimizer holds blocks of the parameters, not ranges of them: use "
                "HybridPlugin.save_optimizer / load_optimizer (every rank) instead of the generic path"
            )

    @contextmanager
    def local_loads(self) -> Iterator[None]:
        """Allow `load_master_values` with readers in local (tp-block) coordinates."""
        self._local_loads = True
        try:
            yield
        finally:
            self._local_loads = False


class TPReplicatedOptimizer(_LocalPieces, ReplicatedOptimizer):
    """Every dp rank holds the whole (tp-local) optimizer; gradients are averaged over dp."""

    def __init__(
        self,
        optim: torch.optim.Optimizer,
        names: dict[nn.Parameter, str],
        info: TensorParallelInfo,
        dp_group: Group,
        scaler: DynamicLossScaler | None = None,
    ) -> None:
        super().__init__(optim, names, scaler)
        self.info, self.dp_group = info, dp_group
        self._partial = [p for p, n in zip(self.model_params, self.names, strict=True) if n in info.partial]
        self._reduced = False  # p.grad holds a reduction of this step
        self._carry: dict[int, tuple[nn.Parameter, torch.Tensor]] = {}

    def _summed(self) -> list[nn.Parameter]:
        """Parameters whose gradients are summed over a group other than dp before the dp average
        (sequence-partial ones over tp): a second sum of an already summed gradient would count it
        again, so later backwards of the step accumulate beside it (`_carry`)."""
        return self._partial

    @property
    def replicated(self) -> bool:  # type: ignore[override]
        self._check_generic_path()
        return True

    def load_master_values(self, read: Callable[[str, int, int], torch.Tensor]) -> None:
        self._check_generic_path()
        super().load_master_values(read)

    def _before_backward(self) -> None:
        """A backward after this step's reduction: move the summed gradients of `_summed()` aside
        (no copy) so the next tp sum sees only the new local gradients. The dp average needs no
        such care: every dp rank holds the same average, and Σ_dp (avg + g') / dp = avg + avg'."""
        super()._before_backward()
        if not self._reduced:
            return
        for p in self._summed():
            if p.grad is not None:
                self._carry[id(p)] = (p, p.grad)
                p.grad = None
        self._reduced = False

    def _add_carry(self) -> None:
        for p, grad in self._carry.values():
            p.grad = grad if p.grad is None else p.grad.add_(grad)
        self._carry.clear()

    def _finish_backward(self) -> None:
        _sum_over([p.grad for p in self._partial if p.grad is not None], self.info.group)
        self._add_carry()
        dp = dist.get_world_size(self.dp_group) if dist.is_initialized() else 1
        _sum_over([p.grad for p in self.model_params if p.grad is not None], self.dp_group, 1.0 / dp)
        self._reduced = True

    def _master_grads(self) -> list[torch.Tensor]:
        self._add_carry()  # a backward after the reduction, none synchronised since
        return super()._master_grads()

    def _zero_grad(self) -> None:
        self._carry.clear()
        self._reduced = False
        super()._zero_grad()

    def clip_grad_by_norm(self, max_norm: float) -> float:
        grads = self._prepare()
        total = tp_grad_norm(self, self.info, self.info.group)  # dp ranks hold identical gradients
        self.last_grad_norm = total
        clip_grads_(grads, max_norm, total)
        return total


class TPZeroOptimizer(_LocalPieces, ZeroOptimizer):
    """ZeRO-1/2 over the dp group on the tp-local parameters."""

    def __init__(
        self,
        optim: torch.optim.Optimizer,
        names: dict[nn.Parameter, str],
        config: ZeroConfig,
        info: TensorParallelInfo,
        dp_group: Group,
        scaler: DynamicLossScaler | None = None,
    ) -> None:
        self.info = info
        self._partial = [p for g in optim.param_groups for p in g["params"] if names.get(p) in info.partial]
        self._tp_summed = False
        self._carry_tp: list[tuple[nn.Parameter, torch.Tensor]] = []
        super().__init__(optim, names, config, dp_group, scaler)

    @property
    def replicated(self) -> bool:  # type: ignore[override]
        self._check_generic_path()
        return False

    def load_master_values(self, read: Callable[[str, int, int], torch.Tensor]) -> None:
        self._check_generic_path()
        super().load_master_values(read)

    def _before_backward(self) -> None:
        """ZeRO-2 frees p.grad at the reduction and ZeRO-1 at dp > 1 zeroes its buffers before the
        next backward (`ZeroOptimizer._before_backward`), so the tp sum sees new gradients only. At
        dp = 1 ZeRO-1 accumulates in place: set the tp-summed partial gradients aside and zero them."""
        super()._before_backward()
        if self._tp_summed and self.config.stage == 1 and self.dp_size == 1:
            for p in self._summed():
                if p.grad is not None:
                    self._carry_tp.append((p, p.grad.clone()))
                    p.grad.zero_()
        self._tp_summed = False

    def _finish_backward(self) -> None:
        _sum_over([p.grad for p in self._partial if p.grad is not None], self.info.group)
        for p, grad in self._carry_tp:
            p.grad.add_(grad)  # type: ignore[union-attr]  # views of the flat buffer: never None
        self._carry_tp.clear()
        self._tp_summed = True
        super()._finish_backward()

    def _zero_grad(self) -> None:
        self._carry_tp.clear()
        self._tp_summed = False
        super()._zero_grad()

    def _summed(self) -> list[nn.Parameter]:
        """Parameters summed over a group other than dp before the dp reduction (as
        `TPReplicatedOptimizer._summed`)."""
        return self._partial

    def clip_grad_by_norm(self, max_norm: float) -> float:
        grads = self._prepare()
        total = tp_grad_norm(self, self.info, None)  # shards over dp, blocks over tp: the whole world
        self.last_grad_norm = total
        clip_grads_(grads, max_norm, total)
        return total


def load_pieces(opt: BoostedOptimizer, reader: PieceReader) -> None:
    meta = reader.meta
    check_optimizer_meta(opt, meta, reader.directory)  # class, groups and the parameters of each
    owned = {id(m): refs for m, refs in opt.owned()}
    for group, saved in zip(opt.param_groups, meta["groups"], strict=True):
        group.update({k: tuple(v) if isinstance(v, list) else v for k, v in saved["hyper"].items()})
        for master in group["params"]:
            _load_master_state(opt, master, owned[id(master)], saved, reader)
    if isinstance(opt, _LocalPieces):
        with opt.local_loads():
            opt.load_master_values(lambda name, s, e: reader.read(name, MASTER, s, e))
    else:
        opt.load_master_values(lambda name, s, e: reader.read(name, MASTER, s, e))
    if opt.scaler is not None and "scaler" in meta:
        opt.scaler.load_state_dict(meta["scaler"])
