"""Stopping the router without losing a stream silently (docs/router.md, "Stopping").

On SIGTERM the listening socket closes, /health and new requests on open connections get 503, and
the generation requests in flight get `--drain-timeout` to finish (a second signal ends the wait at
once). Those still running then are cut on purpose: a stream ends with an error event and `[DONE]`
(its backend calls are closed, so the instances abort and the prefill's KV is released), a
non-streamed request gets a 503.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

SHUTDOWN = "mtpserve router shutdown"  # the cancel message of a request cut at the end of the drain
SHUTDOWN_MESSAGE = "The router is shutting down."


class Drain:
    def __init__(self) -> None:
        self.draining = False
        self._active: set[asyncio.Task] = set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._hurry = asyncio.Event()

    @contextlib.contextmanager
    def request(self) -> Iterator[None]:
        """Count the current generation request (its handler's task) for the drain."""
        task = asyncio.current_task()
        assert task is not None, "called from a handler's task"
        self._active.add(task)
        self._idle.clear()
        try:
            yield
        finally:
            self._active.discard(task)
            if not self._active:
                self._idle.set()

    def hurry(self) -> None:
        """End the wait now (a second SIGTERM)."""
        self._hurry.set()

    async def run(self, timeout: float) -> int:
        """Refuse new work, wait up to `timeout` for the requests in flight (or until `hurry()`), cut
        the rest; returns how many were cut."""
        self.draining = True
        waits = [asyncio.ensure_future(self._idle.wait()), asyncio.ensure_future(self._hurry.wait())]
        await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        for wait in waits:
            wait.cancel()
        cut = list(self._active)
        for task in cut:
            task.cancel(SHUTDOWN)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), 5.0)
        return len(cut)


def is_shutdown(exc: asyncio.CancelledError) -> bool:
    """The cancellation is the drain's cut, not a client that went away."""
    return bool(exc.args) and exc.args[0] == SHUTDOWN


def absorb_cut() -> None:
    """The handler answers the cut itself (error event or 503) and returns normally."""
    task = asyncio.current_task()
    if task is not None:
        task.uncancel()
