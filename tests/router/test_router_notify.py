"""The router under systemd's notify protocol, against a datagram socket the test owns: READY=1 once
it listens, WATCHDOG=1 while its loop turns (stopping when the process is SIGSTOPped), STOPPING=1 on
SIGTERM."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

WATCHDOG_USEC = 400_000  # pings every 0.2 s


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def notify(tmp_path):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(tmp_path / "notify.sock"))
    sock.settimeout(10)
    yield str(tmp_path / "notify.sock"), sock
    sock.close()


def _messages(sock: socket.socket, seconds: float) -> list[str]:
    out, deadline = [], time.monotonic() + seconds
    while time.monotonic() < deadline:
        sock.settimeout(max(deadline - time.monotonic(), 0.01))
        try:
            out.append(sock.recv(4096).decode())
        except TimeoutError:
            break
    return out


def test_ready_watchdog_and_stopping(notify):
    path, sock = notify
    env = {**os.environ, "NOTIFY_SOCKET": path, "WATCHDOG_USEC": str(WATCHDOG_USEC)}
    backend = f"http://127.0.0.1:{_free_port()}"  # NOTE: readiness does not wait for backends
    proc = subprocess.Popen([sys.executable, "-m", "mtpserve.router.main", "--prefill", backend,
                             "--decode", backend, "--port", str(_free_port())], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert sock.recv(4096).decode().startswith("READY=1")
        assert sum(m == "WATCHDOG=1" for m in _messages(sock, 1.0)) >= 3
        proc.send_signal(signal.SIGSTOP)
        _messages(sock, 0.1)  # NOTE: a ping may have been in flight
        assert _messages(sock, 1.0) == []
        proc.send_signal(signal.SIGCONT)
        proc.send_signal(signal.SIGTERM)
        assert any(m.startswith("STOPPING=1") for m in _messages(sock, 5.0))
        assert proc.wait(15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
