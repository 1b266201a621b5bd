"""Deterministic, order-independent initialisation — the same values whether a model is built
eagerly or on the meta device and materialised shard by shard.

Every module that directly holds parameters or buffers is initialised by `init_fn(module)` under
its own RNG seed, derived from (global seed, module path) — so a parameter's value does not depend
on what was initialised before it, nor on which rank materialises which part of it:

    seed(module) = first 8 bytes of sha256(f"{seed}:{path}")  (little-endian, top bit cleared)

`init_fn` defaults to the HF model's `_init_weights(module)` (the root's), else the module's own
`reset_parameters()`. A parameter held by several modules (tied embeddings) takes the value of its
first holder in `named_modules()` order.

*Eager* init means calling `deterministic_init(model, seed)` on a model with real tensors. *Lazy*
init means building the model under `torch.device("meta")` and letting ZeRO-3 materialise it
(`ZeroPlugin(stage=3, init_seed=seed)`): it calls `deterministic_values` and keeps only this
rank's pieces, so at most one module's full parameters exist at a time. Both produce bitwise the
same parameters.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from typing import cast

import torch
from torch import nn

from megalith.common.errors import ConfigError

InitFn = Callable[[nn.Module], None]


def module_seed(seed: int, path: str) -> int:
    digest = hashlib.sha256(f"{seed}:{path}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def default_init_fn(model: nn.Module) -> InitFn:
    found: object = getattr(model, "_init_weights", None)
    hf_init = cast(InitFn, found) if callable(found) else None

    def init(module: nn.Module) -> None:
        if hf_init is not None:
            hf_init(module)
        elif callable(reset := getattr(module, "reset_parameters", None)):
            reset()
        elif any(True for _ in module.parameters(recurse=False)):
            raise ConfigError(
                f"deterministic_init cannot initialise {type(module).__name__}: it has no "
                "reset_parameters() and the model no _init_weights(); pass init_fn"
            )

    return init


def deterministic_values(
    model: nn.Module,
    seed: int,
    device: torch.device,
    init_fn: InitFn | None = None,
    dtype: torch.dtype | None = None,
) -> Iterator[tuple[str, nn.Parameter, torch.Tensor]]:
    """Yield (name, parameter, full initial value) per parameter, one module at a time.

    Each module's parameters are temporarily replaced by fresh tensors on `device` while `init_fn`
    runs (the parameter objects themselves are untouched), in `dtype` (default: the parameter's).
    Buffers on the meta device are materialised on `device` for good and initialised by the same call.
    """
    init = init_fn or default_init_fn(model)
    done: set[int] = set()
    for path, module in model.named_modules():
        own = [(k, p) for k, p in module._parameters.items() if p is not None]
        if not own and not any(b is not None for b in module._buffers.values()):
            continue
        for k, b in module._buffers.items():
            if b is not None and b.is_meta:
                module._buffers[k] = torch.empty_like(b, device=device)
        scratch = {
            k: nn.Parameter(torch.empty(p.shape, dtype=dtype or p.dtype, device=device)) for k, p in own
        }
        try:
            module._parameters.update(scratch)
            with torch.random.fork_rng(devices=[]), torch.no_grad():
                torch.manual_seed(module_seed(seed, path))
                init(module)
        finally:
            module._parameters.update(dict(own))
        for k, p in own:
            if id(p) not in done:
                done.add(id(p))
                yield (f"{path}.{k}" if path else k), p, scratch[k].detach()


def deterministic_init(model: nn.Module, seed: int, init_fn: InitFn | None = None) -> nn.Module:
    """Eager init: overwrite every parameter (and buffer) of a materialised model in place."""
    first = next(model.parameters(), None)
    if first is not None and first.is_meta:
        raise ConfigError("deterministic_init needs real tensors; a meta model is materialised by ZeRO-3")
    device = first.device if first is not None else torch.device("cpu")
    with torch.no_grad():
        for _, p, value in deterministic_values(model, seed, device, init_fn):
            p.copy_(value)
    return model
