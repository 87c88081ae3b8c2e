"""Backend instances of one role and how a request picks one.

Policy: least in-flight requests among the healthy backends; ties go round-robin (the scan starts
after the last backend picked), so an idle pool spreads requests evenly.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

PREFILL, DECODE = "prefill", "decode"


@dataclass(eq=False)  # NOTE: identity: two backends are never "the same" by their fields
class Backend:
    url: str  # scheme://host:port, no trailing slash
    role: str  # PREFILL | DECODE
    healthy: bool = False  # NOTE: unknown until the first /health poll answers
    in_flight: int = 0
    last_error: str = ""

    def mark_unhealthy(self, reason: str) -> None:
        self.healthy, self.last_error = False, reason

    def mark_healthy(self) -> None:
        self.healthy, self.last_error = True, ""

    def describe(self) -> dict:
        return {"url": self.url, "healthy": self.healthy, "in_flight": self.in_flight,
                "last_error": self.last_error or None}


class BackendPool:
    def __init__(self, role: str, urls: tuple[str, ...]) -> None:
        self.role = role
        self.backends = [Backend(url, role) for url in urls]
        self._next = 0  # where the next tie-breaking scan starts

    @property
    def num_healthy(self) -> int:
        return sum(b.healthy for b in self.backends)

    def pick(self, exclude: tuple[Backend, ...] = ()) -> Backend | None:
        """The healthy backend with the fewest requests in flight, other than `exclude`; None when
        there is none."""
        count = len(self.backends)
        best: tuple[int, int] | None = None  # (in_flight, index)
        for step in range(count):
            index = (self._next + step) % count
            backend = self.backends[index]
            if backend in exclude:
                continue
            if backend.healthy and (best is None or backend.in_flight < best[0]):
                best = (backend.in_flight, index)
        if best is None:
            return None
        self._next = (best[1] + 1) % count
        return self.backends[best[1]]

    def describe(self) -> list[dict]:
        return [b.describe() for b in self.backends]


class Reservation:
    """A request counted against one backend; it moves when the request fails over to another."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        backend.in_flight += 1

    def move_to(self, backend: Backend) -> None:
        self.backend.in_flight -= 1
        self.backend = backend
        backend.in_flight += 1

    def end(self) -> None:
        self.backend.in_flight -= 1


@contextlib.contextmanager
def in_flight(backend: Backend) -> Iterator[Reservation]:
    """Count a request against `backend` (or where it moves) for as long as the block runs."""
    held = Reservation(backend)
    try:
        yield held
    finally:
        held.end()
