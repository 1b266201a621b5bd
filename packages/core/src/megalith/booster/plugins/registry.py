"""Plugins by name, for command lines: `make_plugin("zero2")`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from megalith.booster.plugins.base import Plugin
from megalith.booster.plugins.ddp import DDPPlugin
from megalith.booster.plugins.zero import ZeroPlugin
from megalith.common.errors import ConfigError

_FACTORIES: dict[str, Callable[..., Plugin]] = {
    "ddp": lambda **kw: DDPPlugin(**kw),
    "zero1": lambda **kw: ZeroPlugin(stage=1, **kw),
    "zero2": lambda **kw: ZeroPlugin(stage=2, **kw),
}


def register_plugin(name: str, factory: Callable[..., Plugin]) -> None:
    """Make a plugin available to `make_plugin` (and so to every `--plugin` flag)."""
    _FACTORIES[name] = factory


def plugin_names() -> list[str]:
    return sorted(_FACTORIES)


def check_plugin_name(name: str) -> None:
    """Raise `ConfigError` listing the choices when no plugin is registered under `name` (lets a
    command line refuse a bad `--plugin` before it builds anything)."""
    if name not in _FACTORIES:
        raise ConfigError(f"unknown plugin {name!r}; choose one of {', '.join(plugin_names())}")


def make_plugin(name: str, **options: Any) -> Plugin:
    """Build a plugin by name; unknown names raise `ConfigError` listing the choices."""
    check_plugin_name(name)
    return _FACTORIES[name](**options)
