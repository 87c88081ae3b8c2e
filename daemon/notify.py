"""The systemd notify protocol: datagrams to $NOTIFY_SOCKET (READY=1, WATCHDOG=1, STOPPING=1, STATUS=).

A few lines of socket code rather than a dependency. Without NOTIFY_SOCKET (not under systemd) every
call is a no-op. Abstract sockets ("@name") are supported, as systemd may hand one out.
"""

from __future__ import annotations

import os
import socket


class Notifier:
    """Sends notify messages; `watchdog_interval_s()` tells how often systemd wants WATCHDOG=1."""

    def __init__(self, env: dict[str, str] | None = None) -> None:
        env = dict(os.environ if env is None else env)
        self.address = _address(env.get("NOTIFY_SOCKET", ""))
        self.watchdog_usec = int(env.get("WATCHDOG_USEC", "0") or 0)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) if self.address else None

    @property
    def enabled(self) -> bool:
        return self.sock is not None

    def send(self, *fields: str) -> bool:
        """Send `KEY=VALUE` fields in one datagram; False when not under systemd or the send failed."""
        if self.sock is None or self.address is None:
            return False
        try:
            self.sock.sendto("\n".join(fields).encode(), self.address)
            return True
        except OSError:
            return False

    def ready(self, status: str = "serving") -> bool:
        return self.send("READY=1", f"STATUS={status}")

    def watchdog(self) -> bool:
        return self.send("WATCHDOG=1")

    def stopping(self, status: str = "draining") -> bool:
        return self.send("STOPPING=1", f"STATUS={status}")

    def watchdog_interval_s(self) -> float | None:
        """Half of WatchdogSec, as sd_watchdog_enabled(3) advises; None when no watchdog is set."""
        return self.watchdog_usec / 2e6 if self.watchdog_usec else None


def _address(value: str) -> str | bytes | None:
    if not value:
        return None
    if value.startswith("@"):
        return b"\0" + value[1:].encode()
    return value
