"""Learning-rate schedules as multipliers of the base LR (for `torch.optim.lr_scheduler.LambdaLR`).

Step `s` runs for s = 0 .. total-1 (the multiplier of step s is `f(s)`); W = warmup.

- warmup (every schedule): f(s) = (s + 1) / W for s < W, so the last warmup step reaches 1.
- cosine: f(s) = m + (1 - m) * (1 + cos(pi * p)) / 2 with p = (s - W + 1) / (total - W), so
  decay starts right after warmup and the last step (s = total-1) uses exactly `min_ratio` m.
- wsd (warmup-stable-decay, Hu et al. 2024 "MiniCPM"): warmup, constant 1, then over the last
  D = max(1, round(decay_fraction * total)) steps a linear decay f(s) = 1 - (1 - m) * p with
  p = (s - (total - D) + 1) / D: each of the D decay steps decays, the last one to exactly m.
- constant: warmup, then 1.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from megalith.common.errors import ConfigError


def lr_lambda(
    kind: str, warmup: int, total: int, min_ratio: float = 0.1, decay_fraction: float = 0.2
) -> Callable[[int], float]:
    if total <= 0 or warmup < 0 or not 0.0 <= min_ratio <= 1.0 or not 0.0 < decay_fraction <= 1.0:
        raise ConfigError(
            f"bad schedule: total={total}, warmup={warmup}, min_ratio={min_ratio}, decay_fraction={decay_fraction}"
        )

    def warm(step: int) -> float | None:
        return (step + 1) / warmup if step < warmup else None

    def cosine(step: int) -> float:
        w = warm(step)
        if w is not None:
            return w
        progress = min(1.0, (step - warmup + 1) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    def wsd(step: int) -> float:
        w = warm(step)
        if w is not None:
            return w
        decay_start = total - max(1, int(round(decay_fraction * total)))
        if step < decay_start:
            return 1.0
        progress = min(1.0, (step - decay_start + 1) / max(1, total - decay_start))
        return 1.0 - (1.0 - min_ratio) * progress

    def constant(step: int) -> float:
        w = warm(step)
        return 1.0 if w is None else w

    choices = {"cosine": cosine, "wsd": wsd, "constant": constant}
    if kind not in choices:
        raise ConfigError(f"unknown schedule {kind!r}; choose one of {sorted(choices)}")
    return choices[kind]
