"""Checks of user-given configuration values: a ConfigError naming the field and the value.

`bool` is an `int` in Python, and `2.0 == 2`: both would pass a plain `value >= 1`, then fail much
later (as a mesh stride, a bucket size, a string parsed as a number), so the type is checked first.
"""

from __future__ import annotations

import math
import numbers

from megalith.common.errors import ConfigError


def check_int(name: str, value: object, minimum: int = 1) -> None:
    """`value` is an integer (not a bool or a float such as 2.0) and at least `minimum`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ConfigError(f"{name} must be an integer >= {minimum}, got {value!r} ({type(value).__name__})")
    if int(value) < minimum:
        raise ConfigError(f"{name} must be >= {minimum}, got {value!r}")


def check_positive(name: str, value: object) -> None:
    """`value` is a finite real number > 0 (not a bool or a string)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ConfigError(f"{name} must be a number > 0, got {value!r} ({type(value).__name__})")
    if not (float(value) > 0 and math.isfinite(value)):
        raise ConfigError(f"{name} must be > 0, got {value!r}")


def check_fraction(name: str, value: object) -> None:
    """`value` is a real number in [0, 1] (not a bool or a string)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ConfigError(f"{name} must be a number in [0, 1], got {value!r} ({type(value).__name__})")
    if not 0.0 <= float(value) <= 1.0:
        raise ConfigError(f"{name} must be in [0, 1], got {value!r}")


def check_bool(name: str, value: object, optional: bool = False) -> None:
    """`value` is True or False (or None when `optional`); a truthy string is not a flag."""
    if isinstance(value, bool) or (optional and value is None):
        return
    allowed = "True, False or None" if optional else "True or False"
    raise ConfigError(f"{name} must be {allowed}, got {value!r} ({type(value).__name__})")
