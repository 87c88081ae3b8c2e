"""Backend instances of one role and how a request picks one (the rule itself: policy.py).

A failover pick (failover.py) takes the least loaded of the instances not tried yet; ties go
round-robin (the scan starts after the last backend picked), so an idle pool spreads requests evenly.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from mtpserve.router.policy import CACHE, MISS, Choice, PolicyConfig, choose
from mtpserve.router.prefix_index import PrefixSet

PREFILL, DECODE, MIXED = "prefill", "decode", "mixed"
DEFAULT_PREFIX_KEYS = 1 << 16  # per instance: 64k chunks of 64 characters, ~4 MiB of prompt text


@dataclass(eq=False)  # NOTE: identity: two backends are never "the same" by their fields
class Backend:
    url: str  # scheme://host:port, no trailing slash
    role: str  # PREFILL | DECODE | MIXED
    healthy: bool = False  # NOTE: unknown until the first /health poll answers
    in_flight: int = 0
    last_error: str = ""
    prefixes: PrefixSet = field(default_factory=lambda: PrefixSet(DEFAULT_PREFIX_KEYS))
    # NOTE: the instance's own prefix-cache counters, scraped from its /metrics (None: not seen yet)
    cache_queries: float | None = None
    cache_hits: float | None = None

    def matched(self, keys: Sequence[bytes]) -> int:
        return self.prefixes.match(keys)

    def num_prefixes(self) -> int:
        return len(self.prefixes)

    @property
    def cache_hit_rate(self) -> float:
        return (self.cache_hits or 0.0) / self.cache_queries if self.cache_queries else 0.0

    def mark_unhealthy(self, reason: str) -> None:
        self.healthy, self.last_error = False, reason

    def mark_healthy(self) -> None:
        self.healthy, self.last_error = True, ""

    def describe(self) -> dict:
        return {"url": self.url, "healthy": self.healthy, "in_flight": self.in_flight,
                "last_error": self.last_error or None, "prefixes": self.num_prefixes(),
                "prefix_cache_hit_rate": None if self.cache_queries is None else round(self.cache_hit_rate, 4)}


class BackendPool:
    def __init__(self, role: str, urls: tuple[str, ...], policy: PolicyConfig = PolicyConfig("least_loaded"),
                 max_prefix_keys: int = DEFAULT_PREFIX_KEYS) -> None:
        self.role = role
        self.policy = policy
        self.max_prefix_keys = max_prefix_keys
        self.backends: list[Backend] = []
        self._next = 0  # where the next tie-breaking scan starts
        self.set_urls(urls)

    @property
    def num_healthy(self) -> int:
        return sum(b.healthy for b in self.backends)

    @property
    def urls(self) -> tuple[str, ...]:
        return tuple(b.url for b in self.backends)

    def set_urls(self, urls: tuple[str, ...]) -> tuple[list[Backend], list[Backend]]:
        """The pool becomes these instances, in this order: (added, removed). Kept instances keep their
        state; a removed one leaves the pool at once, and requests in flight on it run to their end."""
        kept = {b.url: b for b in self.backends}
        self.backends = [kept.get(url) or Backend(url, self.role, prefixes=PrefixSet(self.max_prefix_keys))
                         for url in urls]
        added = [b for b in self.backends if b.url not in kept]
        removed = [b for url, b in kept.items() if url not in urls]
        self._next = self._next % max(len(self.backends), 1)
        return added, removed

    def choose(self, keys: Sequence[bytes] = ()) -> tuple[Backend, Choice] | None:
        """The pool's policy picks a healthy instance for a prompt with these prefix keys and
        remembers the prompt for it; None when no instance is healthy."""
        healthy = [b for b in self.backends if b.healthy]
        if not healthy:
            return None
        turn = sum(b.healthy for b in self.backends[:self._next]) % len(healthy)  # NOTE: the scan's start
        choice = choose(self.policy, healthy, keys, turn)
        backend = healthy[choice.position]
        self._next = self.backends.index(backend) + 1
        if keys and choice.reason in (CACHE, MISS):
            # NOTE: a request sent away from its prefix's instance for load does not move the prefix:
            # the prefix would end up on both, each instance's cache holding more distinct prefixes
            backend.prefixes.insert(keys)
        return backend, choice

    def pick(self, exclude: tuple[Backend, ...] = ()) -> Backend | None:
        """The healthy backend with the fewest requests in flight, other than `exclude`; None when
        there is none (failover's pick, and the decode instance's)."""
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
