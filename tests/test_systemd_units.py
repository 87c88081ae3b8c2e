"""The units as installed by the documented steps: rendered into a temporary root, then verified."""

import shutil
import subprocess
from pathlib import Path

import pytest

from mtpserve.preflight import EX_CONFIG

ROOT = Path(__file__).resolve().parents[1]
UNITS = sorted(p.name for p in (ROOT / "systemd").glob("*.service"))


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("root")
    out = subprocess.run(["sh", str(ROOT / "scripts" / "install-systemd.sh"), "--root", str(root),
                          "--prefix", str(ROOT)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return root


def test_install_renders_every_unit_and_the_config(installed):
    for name in UNITS:
        text = (installed / "etc/systemd/system" / name).read_text()
        assert "/opt/mtpserve" not in text and f"{ROOT}/.venv/bin/mtpserve" in text
    assert (installed / "etc/mtpserve/mtpserve.toml").read_text() == \
        (ROOT / "config/mtpserve.example.toml").read_text()
    assert (installed / "etc/mtpserve/router.env").read_text() == \
        (ROOT / "systemd/router.env.example").read_text()


def test_install_keeps_an_existing_config(installed):
    config = installed / "etc/mtpserve/mtpserve.toml"
    config.write_text("[server]\nport = 9\n")
    subprocess.run(["sh", str(ROOT / "scripts/install-systemd.sh"), "--root", str(installed)], check=True,
                   capture_output=True, timeout=60)
    assert config.read_text() == "[server]\nport = 9\n"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
@pytest.mark.parametrize("name", UNITS)
def test_units_pass_systemd_analyze_verify(installed, name):
    unit_dir = installed / "etc/systemd/system"
    target = name.replace("@.service", "@test.service")
    out = subprocess.run(["systemd-analyze", "verify", target], cwd=unit_dir, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and "mtpserve" not in out.stderr, out.stderr


@pytest.mark.parametrize("name", UNITS)
def test_unit_contract(name):
    text = (ROOT / "systemd" / name).read_text()
    for line in ("Type=notify", "KillMode=mixed", "Restart=on-failure", "NoNewPrivileges=yes",
                 "ProtectSystem=strict", "ProtectHome=yes", "PrivateTmp=yes", "WatchdogSec=",
                 "RuntimeDirectory=", "User=mtpserve"):
        assert line in text, line


@pytest.mark.parametrize("name", UNITS)
def test_stop_timeout_outlasts_the_drain(name):
    from mtpserve.config import Config

    text = (ROOT / "systemd" / name).read_text()
    stop = next(int(line.split("=")[1]) for line in text.splitlines() if line.startswith("TimeoutStopSec="))
    assert stop > Config().server.drain_timeout + 10


@pytest.mark.parametrize("name", [u for u in UNITS if "router" not in u])
def test_a_failed_start_up_check_is_not_retried(name):
    """The launcher exits EX_CONFIG when only a change of files or settings can help (daemon/preflight.py)."""
    text = (ROOT / "systemd" / name).read_text()
    assert f"RestartPreventExitStatus={EX_CONFIG}" in text
