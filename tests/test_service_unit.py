"""The example systemd unit (docker/dilocox-node.service): required settings, a stop timeout that fits the drain,
and ``systemd-analyze verify`` where systemd's tools are installed."""

from __future__ import annotations

import configparser
import pwd
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from dilocox.daemon.cli import EXIT_GRACE_S, drain_budget_s
from dilocox.daemon.config import NodeConfig

UNIT = Path(__file__).resolve().parents[1] / "docker" / "dilocox-node.service"


def _unit() -> configparser.ConfigParser:
    parser = configparser.ConfigParser(interpolation=None, strict=True)
    parser.optionxform = str  # systemd keys are case-sensitive
    parser.read_string(UNIT.read_text())
    return parser


def _seconds(value: str) -> float:
    """systemd time span ("90", "90s", "1min 30s") -> seconds."""
    units = {"": 1, "s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600}
    parts = re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]*)", value.strip())
    assert parts and "".join(n + u for n, u in parts) == value.replace(" ", ""), value
    return sum(float(n) * units[u] for n, u in parts)


def test_required_settings():
    unit = _unit()
    service = unit["Service"]
    assert service["Type"] == "simple"
    assert service["ExecStart"] == "/opt/dilocox/.venv/bin/dilocox-node --config /etc/dilocox/node.toml"
    assert (service["User"], service["Group"]) == ("dilocox", "dilocox")
    assert service["Restart"] == "on-failure" and _seconds(service["RestartSec"]) > 0
    assert service["KillMode"] == "mixed" and service["KillSignal"] == "SIGTERM"
    for key, value in (("NoNewPrivileges", "yes"), ("PrivateTmp", "yes"), ("ProtectSystem", "strict"),
                       ("ProtectHome", "yes")):
        assert service[key] == value, key
    assert "/var/lib/dilocox" in service["ReadWritePaths"].split()
    assert "PrivateDevices" not in service  # would hide GPUs
    assert unit["Install"]["WantedBy"] == "multi-user.target"


def test_stop_timeout_fits_the_drain():
    """SIGKILL must not come before the node's own deadlines: drain budget + exit grace (+ a margin)."""
    timeout = _seconds(_unit()["Service"]["TimeoutStopSec"])
    assert timeout >= 90
    assert timeout >= drain_budget_s(NodeConfig()) + EXIT_GRACE_S + 10


def test_systemd_analyze_verify(tmp_path):
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze not found on PATH (install the systemd package to verify the unit)")
    text = UNIT.read_text()
    # the real ExecStart does not exist here; verify checks that the binary is executable
    text = re.sub(r"^ExecStart=\S+", "ExecStart=/bin/true", text, flags=re.M)
    try:
        pwd.getpwnam("dilocox")
    except KeyError:
        text = re.sub(r"^(User|Group)=.*\n", "", text, flags=re.M)
    copy = tmp_path / UNIT.name
    copy.write_text(text)
    done = subprocess.run([tool, "verify", str(copy)], capture_output=True, text=True, timeout=120)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    # unknown keys and unparsable values are only warnings (exit 0): none may name our unit
    ours = [line for line in output.splitlines() if UNIT.name in line]
    assert not ours, ours
