"""`BoostedOptimizer`: the optimizer object a plugin hands back from `Booster.boost`.

It wraps the user's torch optimizer *in place* (its `param_groups` are re-pointed at fp32 master
tensors when needed), so an LR scheduler built on the user's optimizer keeps working.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megalith.optim.clip import clip_grads_, global_grad_norm
from megalith.optim.grad_scaler import DynamicLossScaler


@dataclass(frozen=True)
class PieceRef:
    """Elements [start, end) of flattened parameter `name` live at [offset, offset + end - start) of
    a master tensor (flattened). The unit of optimizer checkpoints and master initialisation."""

    name: str
    start: int
    end: int
    offset: int


class BoostedOptimizer:
    """backward (loss scaling) → clip_grad_by_norm (global) → step (overflow-synchronised) → zero_grad.

    Subclasses say which fp32 gradient tensors this rank owns (`_master_grads`), whether they are
    sharded over `norm_group` (sum of squares is all-reduced) and how to publish updated weights.
    """

    def __init__(self, optim: torch.optim.Optimizer, scaler: DynamicLossScaler | None = None) -> None:
        self.optim = optim
        self.scaler = scaler
        self.sync_gradients = True
        self._prepared = False
        self.last_grad_norm: float | None = None
        self.skipped_steps = 0

    # -- torch.optim.Optimizer surface -------------------------------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optim.param_groups

    @property
    def state(self) -> Any:
        return self.optim.state

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optim.defaults

    # -- hooks for subclasses ------------------------------------------------------------------
    def _before_backward(self) -> None:
        """Called before every backward (inside `no_sync` too): a wrapper whose gradient buffers
        hold an earlier reduction of this step sets it aside so the next reduction sees only new
        local gradients (accumulation over several synchronised backwards)."""

    def _finish_backward(self) -> None:
        """Called after every backward outside `no_sync` (e.g. flush gradient reductions)."""

    def _master_grads(self) -> list[torch.Tensor]:
        """fp32 gradients of the tensors in `param_groups`, materialised (`.grad` set)."""
        raise NotImplementedError

    def _publish_params(self) -> None:
        """Copy updated master values back into the model's parameters."""

    def _zero_grad(self) -> None:
        raise NotImplementedError

    sharded_grads = False
    norm_group: dist.ProcessGroup | None = None
    replicated = True  # every rank holds the same optimizer state (only rank 0 writes it)

    def owned(self) -> list[tuple[torch.Tensor, list[PieceRef]]]:
        """Every master tensor in `param_groups` with the parameter pieces it holds."""
        raise NotImplementedError

    def param_numels(self) -> dict[str, int]:
        """numel of every full (flattened) parameter this optimizer holds pieces of, by name: what
        an optimizer checkpoint's tensors must have. Empty where unknown (the check is skipped)."""
        return {}

    def master_names(self) -> dict[int, list[str]]:
        """id(master) → the names of the parameters that master tensor stands for (each whole,
        whichever pieces this rank owns). Default: the names of its `owned()` pieces."""
        return {id(m): [ref.name for ref in refs] for m, refs in self.owned()}

    def group_param_names(self) -> list[list[str]]:
        """The sorted parameter names of each param group (checkpoints record them, so a load into
        groups that hold other parameters — matched by position — is refused)."""
        names = self.master_names()
        return [sorted({n for m in g["params"] for n in names.get(id(m), [])}) for g in self.param_groups]

    def _after_master_load(self) -> None:
        """Called after masters were overwritten (e.g. publish them into the model)."""

    def load_masters_from_model(self) -> None:
        """After new weights were loaded into the model's parameters, refresh the masters."""

    def _before_inner_step(self) -> Any:
        """Runs before the wrapped optimizer's step; its return value is passed to `_after_inner_step`."""
        return None

    def _after_inner_step(self, stash: Any) -> None:
        """Runs after the wrapped optimizer's step, before publishing parameters."""

    def _elementwise(self, master: torch.Tensor) -> list[torch.Tensor]:
        """The flattened master and every optimizer state of the same size (Adam's moments...)."""
        return [master.view(-1)] + [
            t.view(-1)
            for t in self.optim.state.get(master, {}).values()
            if isinstance(t, torch.Tensor) and t.numel() == master.numel()
        ]

    def _stash_pieces(self, names: set[str]) -> list[tuple[torch.Tensor, slice, list[torch.Tensor]]]:
        """Copies of the master and state windows of parameters `names`, for `_restore_pieces`
        (used to keep parameters that got no gradient on any rank from moving)."""
        stash = []
        for master, refs in self.owned() if names else []:
            tensors = self._elementwise(master)
            for ref in refs:
                if ref.name in names:
                    window = slice(ref.offset, ref.offset + ref.end - ref.start)
                    stash.append((master, window, [t[window].clone() for t in tensors]))
        return stash

    def _restore_pieces(self, stash: list[tuple[torch.Tensor, slice, list[torch.Tensor]]] | None) -> None:
        for master, window, saved in stash or []:
            # states created by the step in between have no saved copy: they start at 0 anyway
            for t, old in zip(self._elementwise(master), saved, strict=False):
                t[window].copy_(old)

    def load_master_values(self, read: Callable[[str, int, int], torch.Tensor]) -> None:
        """Overwrite every master piece with `read(name, start, end)` (flattened values)."""
        with torch.no_grad():
            for master, pieces in self.owned():
                flat = master.view(-1)
                for ref in pieces:
                    n = ref.end - ref.start
                    flat[ref.offset : ref.offset + n].copy_(read(ref.name, ref.start, ref.end))
        self._after_master_load()

    # -- the verbs ------------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor) -> None:
        scale = self.scaler.scale if self.scaler is not None else 1.0
        self._before_backward()
        (loss * scale if scale != 1.0 else loss).backward()
        if self.sync_gradients:
            self._finish_backward()

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; the backward after the block reduces them all."""
        previous, self.sync_gradients = self.sync_gradients, False
        try:
            yield
        finally:
            self.sync_gradients = previous

    def _prepare(self) -> list[torch.Tensor]:
        grads = self._master_grads()
        if not self._prepared:
            if self.scaler is not None and self.scaler.scale != 1.0:
                inv = 1.0 / self.scaler.scale
                for g in grads:
                    g.mul_(inv)
            self._prepared = True
        return grads

    def clip_grad_by_norm(self, max_norm: float) -> float:
        """Clip the global gradient norm (over every rank) to `max_norm`; returns the norm before clipping."""
        grads = self._prepare()
        total = global_grad_norm(grads, self.norm_group, sharded=self.sharded_grads)
        self.last_grad_norm = total
        clip_grads_(grads, max_norm, total)
        return total

    def _found_inf(self, grads: list[torch.Tensor]) -> bool:
        """True on every rank if any rank has a non-finite gradient (MAX all-reduce over the world)."""
        local = 0.0
        for g in grads:
            if not torch.isfinite(g).all():
                local = 1.0
                break
        flag = torch.tensor([local], dtype=torch.float32, device=grads[0].device if grads else "cpu")
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item() > 0)

    def step(self) -> bool:
        """Apply the update; returns False when the step was skipped for an fp16 overflow."""
        grads = self._prepare()
        if self.scaler is not None:
            found_inf = self._found_inf(grads)
            self.scaler.update(found_inf)
            if found_inf:
                self.skipped_steps += 1
                self._prepared = False
                return False
        stash = self._before_inner_step()
        self.optim.step()
        self._after_inner_step(stash)
        self._publish_params()
        self._prepared = False
        return True

    def zero_grad(self, set_to_none: bool = True) -> None:
        del set_to_none  # buffers are owned by the wrapper; it decides how to clear them
        self._zero_grad()
        self._prepared = False

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"optim": self.optim.state_dict()}
        if self.scaler is not None:
            out["scaler"] = self.scaler.state_dict()
        return out


class ReplicatedOptimizer(BoostedOptimizer):
    """For replicated parameters (single process, DDP): fp32 masters for low-precision parameters
    unless `masters=False` (then the optimizer steps the parameters in their own dtype)."""

    def __init__(
        self,
        optim: torch.optim.Optimizer,
        names: dict[nn.Parameter, str],
        scaler: DynamicLossScaler | None = None,
        masters: bool = True,
    ) -> None:
        super().__init__(optim, scaler)
        self.model_params: list[nn.Parameter] = [
            p for group in optim.param_groups for p in group["params"] if p.requires_grad
        ]
        self.names = [names[p] for p in self.model_params]
        self.mixed = masters and any(p.dtype != torch.float32 for p in self.model_params)
        self.masters: list[torch.Tensor] = list(self.model_params)
        if self.mixed:
            self._make_masters()

    def _make_masters(self) -> None:
        mapping: dict[int, torch.Tensor] = {}
        for group in self.optim.param_groups:
            masters = []
            for p in group["params"]:
                if not p.requires_grad:
                    continue
                m = p.detach().float().clone()
                mapping[id(p)] = m
                masters.append(m)
            group["params"] = masters
        self.masters = [mapping[id(p)] for p in self.model_params]

    def owned(self) -> list[tuple[torch.Tensor, list[PieceRef]]]:
        return [
            (m, [PieceRef(name, 0, m.numel(), 0)]) for m, name in zip(self.masters, self.names, strict=True)
        ]

    def param_numels(self) -> dict[str, int]:
        return {name: p.numel() for p, name in zip(self.model_params, self.names, strict=True)}

    def master_names(self) -> dict[int, list[str]]:
        return {id(m): [name] for m, name in zip(self.masters, self.names, strict=True)}

    def _after_master_load(self) -> None:
        self._publish_params()

    def load_masters_from_model(self) -> None:
        """After new weights were loaded into the model, refresh the fp32 masters from it."""
        if self.mixed:
            with torch.no_grad():
                for p, m in zip(self.model_params, self.masters, strict=True):
                    m.copy_(p)

    def _master_grads(self) -> list[torch.Tensor]:
        if not self.mixed:
            return [p.grad for p in self.model_params if p.grad is not None]
        if not self._prepared:
            for p, m in zip(self.model_params, self.masters, strict=True):
                m.grad = None if p.grad is None else p.grad.float()
        return [m.grad for m in self.masters if m.grad is not None]

    def _publish_params(self) -> None:
        if self.mixed:
            with torch.no_grad():
                for p, m in zip(self.model_params, self.masters, strict=True):
                    p.copy_(m)

    def _zero_grad(self) -> None:
        for p in self.model_params:
            p.grad = None
        if self.mixed:
            for m in self.masters:
                m.grad = None
