"""Parallelism plugins for the Booster."""

from megalith.booster.plugins.base import MemoryPlan, Plugin
from megalith.booster.plugins.ddp import DDPConfig, DDPPlugin
from megalith.booster.plugins.zero import ZeroPlugin

__all__ = ["DDPConfig", "DDPPlugin", "MemoryPlan", "Plugin", "ZeroPlugin"]
