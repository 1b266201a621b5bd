"""Dynamic loss scaling for fp16 (Micikevicius et al. 2018, "Mixed Precision Training")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megalith.common.errors import ConfigError


@dataclass
class DynamicLossScaler:
    """loss × S before backward; grads ÷ S before the update.

    On overflow (any inf/NaN in any rank's gradients, decided collectively by the caller) the step
    is skipped and S ← S × backoff; after `growth_interval` clean steps S ← S × growth.
    """

    scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 1000
    min_scale: float = 1.0
    clean_steps: int = 0

    def __post_init__(self) -> None:
        if self.scale <= 0 or not 0 < self.backoff_factor < 1 or self.growth_factor <= 1:
            raise ConfigError(
                f"invalid loss scaler: scale={self.scale}, backoff={self.backoff_factor}, growth={self.growth_factor}"
            )

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            self.clean_steps = 0
            return
        self.clean_steps += 1
        if self.clean_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.clean_steps = 0

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "clean_steps": self.clean_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale, self.clean_steps = float(state["scale"]), int(state["clean_steps"])
