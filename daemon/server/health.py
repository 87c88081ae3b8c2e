"""Is the engine making progress? `/health` answers 200 only while it is.

States: starting (no EngineReady yet) -> ready -> draining (SIGTERM) | dead (channel or output path
closed). While ready, the engine's periodic EngineStats are the heartbeat: none for
`heartbeat_timeout_s`, or a step counter frozen while requests run for as long, means no progress.
"""

from __future__ import annotations

import asyncio
import enum
import time

from mtpserve.ipc.request_channel import EngineStats


class EngineState(enum.Enum):
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    DEAD = "dead"


class EngineHealth:
    def __init__(self, heartbeat_timeout_s: float = 10.0) -> None:
        self.state = EngineState.STARTING
        self.reason = "engine starting"
        self._timeout = heartbeat_timeout_s
        self._last_heard = time.monotonic()
        self._last_progress = time.monotonic()
        self._last_step = -1
        # NOTE: set when this process can never serve again though the engine may live (the output path
        # was removed from under it): the process exits so the supervisor restarts the instance.
        self.unrecoverable = asyncio.Event()

    def ready(self) -> None:
        self.state, self.reason = EngineState.READY, ""
        self._last_heard = self._last_progress = time.monotonic()

    def dead(self, reason: str) -> None:
        self.state, self.reason = EngineState.DEAD, reason

    def draining(self) -> None:
        if self.state is not EngineState.DEAD:
            self.state, self.reason = EngineState.DRAINING, "draining"

    def heard(self, stats: EngineStats) -> None:
        now = time.monotonic()
        self._last_heard = now
        if stats.step_id != self._last_step or stats.num_running + stats.num_waiting == 0:
            self._last_progress = now
        self._last_step = stats.step_id

    def problem(self) -> str | None:
        """None when healthy, else why not."""
        if self.state is not EngineState.READY:
            return self.reason
        now = time.monotonic()
        if now - self._last_heard > self._timeout:
            return f"no engine heartbeat for {now - self._last_heard:.1f}s"
        if now - self._last_progress > self._timeout:
            return f"engine made no progress for {now - self._last_progress:.1f}s"
        return None

    @property
    def accepting(self) -> bool:
        return self.state is EngineState.READY
