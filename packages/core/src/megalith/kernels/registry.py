"""One registry for every kernel: a name maps to a Triton and a torch implementation.

`get_kernel(name)` returns a dispatcher that picks the backend per call from the tensors it gets:

- ``MEGALITH_KERNELS=torch`` forces the torch fallbacks (``triton`` forces Triton; unset/``auto``
  picks automatically);
- Triton when it is importable and the first tensor is on CUDA, or when ``TRITON_INTERPRET=1``
  is set and every floating tensor argument is fp32 (the interpreter runs fp32 only);
- the torch fallback otherwise (CPU without the interpreter, bf16 on CPU, no Triton installed).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable
from functools import cache
from typing import Any

import torch

from megalith.common.errors import ConfigError, MissingDependencyError

BACKENDS = ("triton", "torch")
ENV = "MEGALITH_KERNELS"

KernelFn = Callable[..., Any]
_REGISTRY: dict[str, dict[str, KernelFn]] = {}


def register_kernel(name: str, backend: str) -> Callable[[KernelFn], KernelFn]:
    """Decorator: register `fn` as the `backend` implementation of kernel `name`."""
    if backend not in BACKENDS:
        raise ConfigError(f"kernel backend must be one of {BACKENDS}, got {backend!r}")

    def deco(fn: KernelFn) -> KernelFn:
        _REGISTRY.setdefault(name, {})[backend] = fn
        return fn

    return deco


def kernel_names() -> list[str]:
    return sorted(_REGISTRY)


@cache
def triton_available() -> bool:
    """True when the `triton` package can be imported (it is never imported here)."""
    return importlib.util.find_spec("triton") is not None


def interpret_mode() -> bool:
    """TRITON_INTERPRET is set *and* took effect: Triton reads it when it is first imported, so
    setting it after an import leaves compiled-mode kernels that cannot run on CPU tensors."""
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        return False
    language = sys.modules.get("triton.language")
    return language is None or type(language.standard.sum).__name__ != "JITFunction"


def forced_backend() -> str | None:
    value = os.environ.get(ENV, "auto").strip().lower()
    if value in ("", "auto"):
        return None
    if value not in BACKENDS:
        raise ConfigError(f"{ENV} must be 'auto', 'triton' or 'torch', got {value!r}")
    return value


def _tensors(args: tuple[Any, ...]) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out.extend(t for t in a if isinstance(t, torch.Tensor))
    return out


def pick_backend(*args: Any) -> str:
    """The backend `get_kernel(name)` would use for these arguments (see the module docstring)."""
    forced = forced_backend()
    if forced == "torch":
        return "torch"
    if forced == "triton":
        if not triton_available():
            raise MissingDependencyError(f"{ENV}=triton but triton is not installed")
        return "triton"
    tensors = _tensors(args)
    if not triton_available() or not tensors:
        return "torch"
    if tensors[0].is_cuda:
        return "triton"
    floats = [t for t in tensors if t.is_floating_point()]
    if interpret_mode() and all(t.dtype == torch.float32 for t in floats):
        return "triton"
    return "torch"


def get_kernel(name: str, backend: str | None = None) -> KernelFn:
    """The implementation of kernel `name`: a fixed `backend`, or (None) a per-call dispatcher."""
    impls = _REGISTRY.get(name)
    if impls is None:
        raise ConfigError(f"unknown kernel {name!r}; registered: {kernel_names()}")
    if backend is not None:
        if backend not in impls:
            raise ConfigError(f"kernel {name!r} has no {backend!r} backend (has {sorted(impls)})")
        return impls[backend]

    def dispatch(*args: Any, **kwargs: Any) -> Any:
        return impls[pick_backend(*args)](*args, **kwargs)

    dispatch.__name__ = f"{name}_dispatch"
    return dispatch
