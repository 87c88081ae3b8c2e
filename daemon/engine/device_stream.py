"""A CPU host's "device": one execution thread that runs submitted work in order, like a stream.

The rank's event loop submits a step and carries on (intake, scheduling the next step) while the
thread executes it; Paddle's kernels and `time.sleep` release the GIL, so the overlap is real.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class DeviceStream:
    def __init__(self, name: str = "device") -> None:
        # NOTE: (future, function, arguments); None stops the thread.
        self._work: queue.SimpleQueue[tuple[concurrent.futures.Future[Any], Callable[..., Any],
                                            tuple[Any, ...]] | None] = queue.SimpleQueue()
        self._busy = 0.0
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._work.put((future, fn, args))
        return future

    def busy_seconds(self) -> float:
        with self._lock:
            return self._busy

    def close(self, timeout: float | None = None) -> None:
        """Stop after the submitted work; with `timeout`, give up waiting (a step stuck in a
        collective with a dead peer never returns, and the thread is a daemon)."""
        if self._thread.is_alive():
            self._work.put(None)
            self._thread.join(timeout)

    def _run(self) -> None:
        while (item := self._work.get()) is not None:
            future, fn, args = item
            start = time.perf_counter()
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting host
                future.set_exception(exc)
            with self._lock:
                self._busy += time.perf_counter() - start
