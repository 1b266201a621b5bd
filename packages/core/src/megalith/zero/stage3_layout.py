"""ZeRO-3 layout: which parameters form a group, and the flat segments they are sharded in.

A *unit* is a module whose forward brackets every use of its parameters; its parameters are
gathered just before that forward (and before its backward) and freed after. Units are chosen
bottom-up by size (FSDP's size-based wrapping): a module whose not-yet-grouped parameters reach
`min_numel` becomes a unit, the root takes the rest. A parameter held by several modules (tied
embeddings) belongs to the unit of their lowest common ancestor, so it is gathered for all uses.
Containers (`ModuleList`, `ModuleDict`) have no forward and are never units.

Inside a unit, the parameters of one optimizer param group form a *segment*: one flat buffer

    flat  [p0 | p1 | ... | pad]           # [padded_numel] in the parameter dtype; storage freed when sharded
    shard          [r*S : (r+1)*S]        # S = padded_numel / dp, persistent (device or pinned host)

whose views the parameters are (storage is resized, never re-pointed, so tensors saved for
backward see the re-gathered values).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from megalith.common.errors import ConfigError
from megalith.zero.buckets import FlatLayout, Slot

FROZEN = -1  # segment key of parameters no optimizer group updates


def free_storage(t: torch.Tensor) -> None:
    if t.untyped_storage().size() > 0:
        t.untyped_storage().resize_(0)


def alloc_storage(t: torch.Tensor) -> None:
    nbytes = t.numel() * t.element_size()
    if t.untyped_storage().size() != nbytes:
        t.untyped_storage().resize_(nbytes)


def _rebind(p: nn.Parameter, view: torch.Tensor) -> None:
    if p.is_meta:  # meta → real needs a swap of the tensor bodies (the Parameter object survives)
        body = nn.Parameter(torch.empty(0, dtype=view.dtype, device=view.device), p.requires_grad)
        body.data = view  # via .data: the parameter keeps its own version counter, so refilling
        torch.utils.swap_tensors(p, body)  # the flat buffer never trips autograd's saved-tensor check
    else:
        p.data = view


class Segment(FlatLayout):
    """The parameters of one unit that share one optimizer param group (`key`, FROZEN = none)."""

    def __init__(
        self,
        named_params: Sequence[tuple[str, nn.Parameter]],
        key: int,
        dp_size: int,
        dp_rank: int,
        device: torch.device,
        shard_device: torch.device,
    ) -> None:
        super().__init__(named_params, dp_size, dp_rank)
        self.key = key
        self.flat = torch.zeros(self.padded_numel, dtype=self.dtype, device=device)
        lazy = named_params[0][1].is_meta
        with torch.no_grad():
            for s in self.slots:
                if not lazy:
                    self.flat[s.offset : s.offset + s.numel].copy_(s.param.detach().reshape(-1))
                _rebind(s.param, self.flat[s.offset : s.offset + s.numel].view(s.param.shape))
        lo, hi = self.shard_range
        self.shard = self.flat[lo:hi].to(shard_device, copy=True)
        if shard_device.type == "cpu" and device.type == "cuda":
            self.shard = self.shard.pin_memory()
        self.grad_acc: torch.Tensor | None = None  # full-size local gradients of this backward / no_sync run
        self.grad_fresh = False  # True after zero_grad until a reduction writes the gradient shard
        free_storage(self.flat)

    @property
    def is_gathered(self) -> bool:
        return self.flat.untyped_storage().size() > 0

    def shard_bytes(self) -> int:
        return self.shard.numel() * self.shard.element_size()


@dataclass
class Unit:
    """A module whose forward brackets the uses of `segments`' parameters."""

    name: str
    module: nn.Module
    segments: list[Segment]
    index: int

    @property
    def numel(self) -> int:
        return sum(s.numel for s in self.segments)

    @property
    def trainable(self) -> list[Slot]:
        return [slot for seg in self.segments if seg.key != FROZEN for slot in seg.slots]

    @property
    def has_frozen(self) -> bool:
        return any(seg.key == FROZEN for seg in self.segments)


def _owner_path(paths: list[str]) -> str:
    """Lowest common ancestor of module paths ("" is the root)."""
    parts = [p.split(".") if p else [] for p in paths]
    common: list[str] = []
    for level in zip(*parts, strict=False):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    return ".".join(common)


def group_parameters(
    model: nn.Module, names: dict[nn.Parameter, str], min_numel: int
) -> list[tuple[str, nn.Module, list[nn.Parameter]]]:
    """[(module path, module, parameters)] of every unit, bottom-up (children before parents)."""
    holders: dict[nn.Parameter, list[str]] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        for p in module._parameters.values():
            if p is not None:
                holders.setdefault(p, []).append(path)
    home: dict[str, list[nn.Parameter]] = {}
    for p in names:  # model.named_parameters() order
        home.setdefault(_owner_path(holders[p]), []).append(p)
    units: list[tuple[str, nn.Module, list[nn.Parameter]]] = []

    def visit(path: str, module: nn.Module) -> list[nn.Parameter]:
        pending = list(home.get(path, []))
        for child_name, child in module.named_children():
            pending += visit(f"{path}.{child_name}" if path else child_name, child)
        container = isinstance(module, nn.ModuleList | nn.ModuleDict)
        if pending and not container and (path == "" or sum(p.numel() for p in pending) >= min_numel):
            order = {p: i for i, p in enumerate(names)}
            units.append((path, module, sorted(pending, key=order.__getitem__)))
            return []
        return pending

    left = visit("", model)
    if left:  # only possible when the root itself is a container
        raise ConfigError(f"the root module {type(model).__name__} is a container without forward")
    return units


def check_dtypes(unit_name: str, params: Sequence[nn.Parameter], names: dict[nn.Parameter, str]) -> None:
    """A unit is sharded as flat buffers of one floating dtype."""
    first = params[0]
    for p in params:
        if not p.is_floating_point():
            raise ConfigError(
                f"ZeRO-3 cannot shard non-floating parameter {names[p]!r} ({p.dtype}); make it a buffer"
            )
        if p.dtype != first.dtype:
            raise ConfigError(
                f"ZeRO-3 shards the parameters of module group {unit_name or '<root>'!r} as one flat "
                f"buffer, but parameter {names[p]!r} is {p.dtype} while {names[first]!r} is {first.dtype}; "
                "cast the model to one dtype (the Booster's precision does)"
            )
