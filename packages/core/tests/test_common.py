"""megalith.common: errors and logging come without torch; the device helpers load it on use."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


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


def test_free_loopback_port_stays_below_the_ephemeral_range(monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    from megalith.common import utils

    low = utils._ephemeral_low()
    for _ in range(20):
        port = utils.free_loopback_port()
        assert 20000 <= port < min(low, 32768)
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # really free

    # a port someone holds is never returned: with it the only candidate, the kernel picks
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        monkeypatch.setattr(utils, "_PICK_LOW", taken)
        monkeypatch.setattr(utils, "_PICK_HIGH", taken)
        monkeypatch.setattr(utils, "_ephemeral_low", lambda: 65535)
        assert utils.free_loopback_port() != taken

    # no quiet range left (it overlaps the ephemeral one): the kernel's choice
    monkeypatch.setattr(utils, "_PICK_LOW", 20000)
    monkeypatch.setattr(utils, "_PICK_HIGH", 32767)
    monkeypatch.setattr(utils, "_ephemeral_low", lambda: 1024)
    assert 1024 <= utils.free_loopback_port() <= 65535
