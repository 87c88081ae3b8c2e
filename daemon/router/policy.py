"""Which healthy instance of a role takes a request (pure: reads in-flight counts and prefix sets).

  * `round_robin`: each in turn, whatever their load.
  * `least_loaded`: the fewest requests in flight (this router's count); ties in turn.
  * `cache_aware` (the default): the instance that has seen the longest prefix of this prompt
    (prefix_index.py), unless
      - the match covers less than `cache_threshold` of the prompt (a miss: the least loaded instance,
        ties to the one remembering the fewest prefixes, so new prefixes spread), or
      - that instance is overloaded: more than `balance_abs` requests in flight beyond the least loaded
        one and more than `balance_rel` times its count (the least loaded instance takes it);
    among instances with equal matches, the least loaded. The prompt is then remembered for the
    instance that took it, unless it went there for load (backends.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

POLICIES = ("cache_aware", "round_robin", "least_loaded")
CACHE, BALANCE, MISS, LOAD, TURN = "cache", "balance", "miss", "load", "turn"  # why an instance was chosen


@dataclass(frozen=True)
class PolicyConfig:
    name: str = "cache_aware"
    cache_threshold: float = 0.5  # matched share of the prompt's chunks below which it is a miss
    balance_abs: int = 16  # in-flight requests beyond the least loaded instance ...
    balance_rel: float = 1.5  # ... and times its count, past which the cache match gives way to load

    def __post_init__(self) -> None:
        if self.name not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {self.name!r}")


class Candidate(Protocol):
    """What a policy reads of an instance (router/backends.py: Backend)."""

    @property
    def in_flight(self) -> int: ...

    def matched(self, keys: Sequence[bytes]) -> int: ...

    def num_prefixes(self) -> int: ...


class Choice(NamedTuple):
    position: int  # into the candidates
    matched: int  # leading prefix keys the chosen instance has seen
    reason: str  # CACHE, BALANCE, MISS, LOAD or TURN


def choose(config: PolicyConfig, candidates: Sequence[Candidate], keys: Sequence[bytes], turn: int) -> Choice:
    """`candidates`: the healthy instances not excluded (non-empty), in pool order; `turn`: where
    round-robin scans start (it rotates tie-breaking too)."""
    order = [(turn + step) % len(candidates) for step in range(len(candidates))]
    if config.name == "round_robin":
        return Choice(order[0], candidates[order[0]].matched(keys), TURN)
    least = min(order, key=lambda i: candidates[i].in_flight)
    if config.name == "least_loaded" or not keys:
        return Choice(least, candidates[least].matched(keys), LOAD)
    matches = [c.matched(keys) for c in candidates]
    best = max(order, key=lambda i: (matches[i], -candidates[i].in_flight))
    if matches[best] < config.cache_threshold * len(keys):
        spread = min(order, key=lambda i: (candidates[i].in_flight, candidates[i].num_prefixes()))
        return Choice(spread, matches[spread], MISS)
    busy, idle = candidates[best].in_flight, candidates[least].in_flight
    if busy - idle > config.balance_abs and busy > config.balance_rel * idle:
        return Choice(least, matches[least], BALANCE)
    return Choice(best, matches[best], CACHE)
