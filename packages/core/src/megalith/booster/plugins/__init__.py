"""Parallelism plugins for the Booster."""

from megalith.booster.plugins.base import MemoryPlan, Plugin
from megalith.booster.plugins.ddp import DDPConfig, DDPPlugin
from megalith.booster.plugins.zero import ZeroPlugin

__all__ = ["DDPConfig", "DDPPlugin", "MemoryPlan", "Plugin", "ZeroPlugin"]

from megalith.booster.plugins.registry import check_plugin_name, make_plugin, plugin_names, register_plugin

__all__ += ["check_plugin_name", "make_plugin", "plugin_names", "register_plugin"]

from megalith.booster.plugins.hybrid import HybridConfig, HybridPlugin  # noqa: E402

__all__ += ["HybridConfig", "HybridPlugin"]

from megalith.booster.plugins.fsdp import FSDPConfig, FSDPPlugin  # noqa: E402

__all__ += ["FSDPConfig", "FSDPPlugin"]
