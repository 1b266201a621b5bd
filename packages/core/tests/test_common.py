"""megalith.common: errors and logging come without torch; the device helpers load it on use."""

from __future__ import annotations

import json
import subprocess
import sys


def _modules_after(code: str) -> list[str]:
    """The heavy top-level packages (torch, numpy) a fresh interpreter has imported after `code`."""
    probe = f"import json, sys; {code}; print(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}} & {{'torch', 'numpy'}})))"
    return json.loads(
        subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    )


def test_errors_and_logging_do_not_import_torch() -> None:
    code = "from megalith.common import ConfigError, get_logger; import megalith.common.logging"
    assert _modules_after(code) == []


def test_device_helpers_resolve_lazily() -> None:
    import megalith.common as common
    from megalith.common.device import Device, get_device

    assert common.get_device is get_device and common.Device is Device
    assert common.get_device("cpu").type == "cpu"
