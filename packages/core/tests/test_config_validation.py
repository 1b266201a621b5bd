"""Bad constructor arguments are refused at construction with a ConfigError naming the value."""

from __future__ import annotations

import pytest

from megalith.booster import Booster
from megalith.common.errors import ConfigError


@pytest.mark.parametrize("plugin", ["zero2", 2])
def test_booster_refuses_a_plugin_that_is_not_a_plugin(plugin: object) -> None:
    with pytest.raises(ConfigError, match=f"got {plugin!r}"):
        Booster(plugin=plugin)  # type: ignore[arg-type]
