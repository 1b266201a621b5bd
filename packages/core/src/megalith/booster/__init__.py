"""Booster, plugins, precision and `plan()` (layer 7)."""

from megalith.booster.booster import Booster
from megalith.booster.plan import plan
from megalith.booster.plugins import DDPPlugin, MemoryPlan, Plugin, ZeroPlugin
from megalith.booster.precision import Precision

__all__ = ["Booster", "DDPPlugin", "MemoryPlan", "Plugin", "Precision", "ZeroPlugin", "plan"]

from megalith.booster.plugins.hybrid import HybridConfig, HybridPlugin

__all__ += ["HybridConfig", "HybridPlugin"]

from megalith.booster.plugins.fsdp import FSDPConfig, FSDPPlugin  # noqa: E402

__all__ += ["FSDPConfig", "FSDPPlugin"]
