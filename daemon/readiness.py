"""Tell systemd the truth about the instance: READY once it can serve, WATCHDOG while it makes progress.

The launcher's only window on health is the HTTP process's /health, which answers 200 only after rank 0
announced EngineReady (model loaded and warmed up), the site listens, and rank 0's heartbeats keep
arriving. So READY=1 is sent at the first 200, and each WATCHDOG=1 ping needs a fresh 200: a wedged or
stopped rank loop stops the heartbeats, /health turns 503, the pings stop and systemd acts.
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request

from mtpserve.config import Config
from mtpserve.notify import Notifier

STARTUP_PROBE_S = 0.5
PROBE_TIMEOUT_S = 1.0


def health_url(config: Config) -> str:
    host = config.server.host
    host = "127.0.0.1" if host in ("0.0.0.0", "") else "::1" if host == "::" else host
    host = f"[{host}]" if ":" in host else host
    return f"http://{host}:{config.server.port}/health"


def probe(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=PROBE_TIMEOUT_S) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


class Readiness:
    """Call `tick()` from the supervision loop; it probes at most once per interval."""

    def __init__(self, notifier: Notifier, url: str) -> None:
        self.notifier = notifier
        self.url = url
        self.is_ready = False
        self._next_probe = 0.0

    def tick(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if not self.notifier.enabled or now < self._next_probe:
            return
        interval = self.notifier.watchdog_interval_s() if self.is_ready else STARTUP_PROBE_S
        if interval is None:
            return  # ready, and systemd asked for no watchdog: nothing left to say
        self._next_probe = now + interval
        if probe(self.url):
            self._report_healthy()

    def _report_healthy(self) -> None:
        if self.is_ready:
            self.notifier.watchdog()
        else:
            self.is_ready = self.notifier.ready()

    def stopping(self) -> None:
        self.notifier.stopping()
