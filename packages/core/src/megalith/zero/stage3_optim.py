"""`Zero3Optimizer`: the BoostedOptimizer of ZeRO-3 (sharded parameters, gradients, optimizer states).

Each trainable segment (see `stage3_layout.py`) has on this rank:
    shard       [S]  parameter dtype      device, or host when its unit is parameter-offloaded
    grad_shard  [S]  fp32                 where the optimizer update runs
    master      [S]  fp32                 the shard itself when dtype and placement agree, else a copy
Static placement (Gemini-style): units are taken in order until `offload_optim_frac` (resp.
`offload_param_frac`) of the elements is reached; those keep masters, gradient shards and
optimizer states (resp. parameter shards) in host memory and are updated by the CPU. The step
updates the masters and copies them into the parameter shards; no all-gather follows — the next
forward gathers.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megalith.distributed import comm_device
from megalith.optim import BoostedOptimizer, DynamicLossScaler, PieceRef, prefer_fused
from megalith.zero.config import ZeroConfig
from megalith.zero.stage3 import ParamSharder
from megalith.zero.stage3_layout import FROZEN, Segment, Unit, check_dtypes, group_parameters

HOST = torch.device("cpu")


def _prefix(units: list[tuple[str, nn.Module, list[nn.Parameter]]], frac: float) -> set[int]:
    """Indices of the first units holding `frac` of all elements (static placement)."""
    total = sum(p.numel() for _, _, ps in units for p in ps)
    chosen: set[int] = set()
    acc = 0
    for i, (_, _, ps) in enumerate(units):
        if frac <= 0 or acc >= frac * total - 0.5:
            break
        chosen.add(i)
        acc += sum(p.numel() for p in ps)
    return chosen


def build_units(
    model: nn.Module,
    names: dict[nn.Parameter, str],
    group_of: dict[nn.Parameter, int],
    config: ZeroConfig,
    device: torch.device,
    dp: tuple[int, int],
) -> tuple[list[Unit], set[int], set[int]]:
    """Units with their segments; returns (units, optimizer-offloaded, parameter-offloaded indices)."""
    first = next(iter(names))
    raw = group_parameters(model, names, config.bucket_numel(first.element_size()))
    optim_off = _prefix(raw, config.optim_offload_fraction)
    param_off = _prefix(raw, config.offload_param_frac)
    units = []
    for index, (path, module, params) in enumerate(raw):
        check_dtypes(path, params, names)
        shard_device = HOST if index in param_off else device
        segments = []
        for key in sorted({group_of.get(p, FROZEN) for p in params}):
            members = [(names[p], p) for p in params if group_of.get(p, FROZEN) == key]
            segments.append(Segment(members, key, dp[0], dp[1], device, shard_device))
        units.append(Unit(path, module, segments, index))
    return units, optim_off, param_off


class Zero3Optimizer(BoostedOptimizer):
    sharded_grads = True
    replicated = False

    def __init__(
        self,
        optim: torch.optim.Optimizer,
        model: nn.Module,
        names: dict[nn.Parameter, str],
        config: ZeroConfig,
        dp_group: dist.ProcessGroup | None = None,
        scaler: DynamicLossScaler | None = None,
        device: torch.device | None = None,
    ) -> None:
        self._sharder: ParamSharder | None = None
        super().__init__(optim, scaler)
        self.config = config
        self.dp_group = self.norm_group = dp_group
        dp_size = dist.get_world_size(dp_group) if dist.is_initialized() else 1
        dp_rank = dist.get_rank(dp_group) if dist.is_initialized() else 0
        group_of = {p: i for i, g in enumerate(optim.param_groups) for p in g["params"] if p.requires_grad}
        device = device or next(iter(names)).device
        self.units, self.optim_off, self.param_off = build_units(
            model, names, group_of, config, device, (dp_size, dp_rank)
        )
        on_cuda = device.type == "cuda"
        self.device = device
        overlap = on_cuda if config.overlap_communication is None else config.overlap_communication
        prefetch = on_cuda if config.prefetch is None else config.prefetch
        self.sharder = ParamSharder(self.units, dp_group, overlap, prefetch)
        self._sharder = self.sharder
        self.segments: list[Segment] = []
        self.masters: list[torch.Tensor] = []
        per_group: list[list[torch.Tensor]] = [[] for _ in optim.param_groups]
        for unit in self.units:
            for seg in unit.segments:
                if seg.key != FROZEN:
                    master = self._make_master(unit, seg, device)
                    self.segments.append(seg)
                    self.masters.append(master)
                    per_group[seg.key].append(master)
        for group, masters in zip(optim.param_groups, per_group, strict=True):
            group["params"] = masters
        self._async_host_grads = on_cuda and bool(self.optim_off)
        if any(m.device.type == "cpu" for m in self.masters) and device.type != "cpu":
            prefer_fused(optim)  # the offloaded update runs on the host: one fused pass, not ten

    def _make_master(self, unit: Unit, seg: Segment, device: torch.device) -> torch.Tensor:
        optim_host = unit.index in self.optim_off
        where = HOST if optim_host else device
        seg.grad_shard = torch.zeros(seg.shard_numel, dtype=torch.float32, device=where)  # type: ignore[attr-defined]
        if optim_host and device.type == "cuda":
            seg.grad_shard = seg.grad_shard.pin_memory()  # type: ignore[attr-defined]
        if seg.dtype == torch.float32 and optim_host == (unit.index in self.param_off):
            return seg.shard  # the parameter shard is the master: no copy
        master = seg.shard.to(where, torch.float32, copy=True)
        return master.pin_memory() if optim_host and device.type == "cuda" else master

    # -- no_sync goes through the sharder's flag -------------------------------------------------------
    @property
    def sync_gradients(self) -> bool:
        return self._sharder.sync if self._sharder is not None else True

    @sync_gradients.setter
    def sync_gradients(self, value: bool) -> None:
        if self._sharder is not None:
            self._sharder.sync = value

    # -- BoostedOptimizer hooks -------------------------------------------------------------------------
    def _finish_backward(self) -> None:
        self.sharder.finish_reductions()

    def _master_grads(self) -> list[torch.Tensor]:
        if self._async_host_grads:  # offloaded gradient shards arrive by asynchronous copies
            torch.cuda.current_stream(self.device).synchronize()
        for seg in self.segments:
            if seg.grad_fresh:  # no reduction wrote it since zero_grad: the gradient is zero
                seg.grad_shard.zero_()  # type: ignore[attr-defined]
                seg.grad_fresh = False
        if not self._prepared:
            for seg, master in zip(self.segments, self.masters, strict=True):
                master.grad = seg.grad_shard  # type: ignore[attr-defined]
        return [m.grad for m in self.masters if m.grad is not None]

    def _publish_params(self) -> None:
        with torch.no_grad():
            for seg, master in zip(self.segments, self.masters, strict=True):
                if master is not seg.shard:
                    seg.shard.copy_(master)

    def _zero_grad(self) -> None:
        self.sharder.got_grad.clear()
        for seg, master in zip(self.segments, self.masters, strict=True):
            seg.grad_fresh = True  # the next reduction overwrites the shard (no zeroing pass)
            seg.grad_acc = None
            master.grad = None

    def _before_inner_step(self) -> Any:
        """Parameters no rank saw a gradient for must not move (a torch optimizer skips grad=None)."""
        slots = [s for seg in self.segments for s in seg.slots]
        flags = torch.tensor(
            [s.name in self.sharder.got_grad for s in slots],
            dtype=torch.uint8,
            device=comm_device(self.dp_group),
        )
        if dist.is_initialized() and self.sharder.dp_size > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.dp_group)
        unused = {s.name for s, f in zip(slots, flags.tolist(), strict=True) if not f}
        return self._stash_pieces(unused)

    def _after_inner_step(self, stash: Any) -> None:
        self._restore_pieces(stash)

    def owned(self) -> list[tuple[torch.Tensor, list[PieceRef]]]:
        return [(m, seg.pieces()) for seg, m in zip(self.segments, self.masters, strict=True)]

    def param_numels(self) -> dict[str, int]:
        return {s.name: s.numel for seg in self.segments for s in seg.slots}

    def master_names(self) -> dict[int, list[str]]:
        return {
            id(m): [s.name for s in seg.slots] for seg, m in zip(self.segments, self.masters, strict=True)
        }

    def _after_master_load(self) -> None:
        self._publish_params()

    def load_masters_from_model(self) -> None:
        """After new values were written into the parameter shards, refresh the masters."""
        with torch.no_grad():
            for seg, master in zip(self.segments, self.masters, strict=True):
                if master is not seg.shard:
                    master.copy_(seg.shard)

    def memory_bytes(self) -> dict[str, int]:
        """This rank's model-state bytes by placement: params/grads/optimizer_states on the device,
        `host` for what the static placement put in host memory (counted by placement, so a CPU run
        reports what a CUDA run would hold where)."""
        out = {"params": 0, "grads": 0, "optimizer_states": 0, "host": 0}
        for unit in self.units:
            for seg in unit.segments:
                key = "host" if unit.index in self.param_off else "params"
                out[key] += seg.shard_bytes()
        by_seg = {id(s): u for u in self.units for s in u.segments}
        for seg, master in zip(self.segments, self.masters, strict=True):
            host = by_seg[id(seg)].index in self.optim_off
            states = sum(
                t.numel() * t.element_size()
                for t in self.optim.state.get(master, {}).values()
                if isinstance(t, torch.Tensor) and t.numel() > 1
            )
            if master is not seg.shard:
                states += master.numel() * master.element_size()
            grads = seg.grad_shard.numel() * 4  # type: ignore[attr-defined]
            out["host" if host else "grads"] += grads
            out["host" if host else "optimizer_states"] += states
        return out
