"""The spell a cell of decode steps is in (spec_extra.py): the depth most of its last steps ran, and how much of
what serving adds is the device thread itself running slower than the profile's curves.

On this host what serving adds to a decode step is mostly the device thread slowed down (at 64 rows on code its
own time was 15.9 ms against the curves' 8.1, the period only ~0.1 ms more): the HTTP process, the clients and
the host loop share the two cores with it. How much follows the spell a step runs in more than the step's own
depth. In four instances at 64 streams on code, depth-1 steps inside depth-0 spells added 7.2-10.3 ms to the
curves and 8.8-12.0 in their own spells; depth-0 steps inside depth-1 spells 9.6-11.4 against 8.0-8.4 in
their own. A depth priced by its few steps among another's (the policy's probes) gets the spell's price, and
the depth in use kept winning its comparisons: at 16 streams one instance ran depth 1 for 69% of its rows
where k0 served 9% more than k1.

So for a depth other than the spell's, the slowed share of its price is the spell depth's own mean scaled to
the depth's own expected tokens a step (their ratio to TOKENS_POWER, spec_extra.ServingExtra.priced); the
rest, time between steps (which the host's work per step makes, as on a GPU host), is priced as before, by each
depth's own mean. By tokens, because the spell's extra grew with them: at 16 streams 1.53 ms for 15.9 tokens a
depth-0 step and 2.03 for 29.2 a depth-1 step (one instance's spells); at one row 0.08, 0.34 and 0.56 ms for
1.1, 1.8 and 2.5 tokens at depths 0-2.

A depth that ran a spell of its own lately is priced by what serving added in it instead (`Regime.settled`): the
power is one constant and the spells measured 0 to 0.98, and either error strands the policy (a shallower depth
priced from a deeper spell looks dearer than it is at too low a power, a deeper one from a shallower spell at too
high a one). Only the steps after the spell's first STEPS: the host settles to a spell over its steps (the tests'
synthetic host over the last 32), and a mean of every step of a spell just begun carries the spell before it.

NOTE: not with what a probe's steps added beyond the spell's mean on top: a probe's first steps carry a
switch's cost too. At 4 streams depth-1 steps right after depth-0 spells added 1.04 ms, 0.81 in their own
spells, and depth 0 after depth 1 0.75 against 0.57; kept as an offset on the scaled price, it priced
depth 1 ~20% of its step high from a depth-0 spell, and one instance ran depth 0 for 53% of rows at 0.905 of
k1.
"""

from __future__ import annotations

import math
from collections import deque

# NOTE: what a spell's decode steps take beyond the curves grew as its tokens a step to this power: in ten
# instances' own spells of depths 0 and 1 (the depth before them for 32 steps), 0.39-0.50 at 16 streams (one
# 0.98), 0.18-0.48 at 64, 0.64 at 4, and ~0 in the stepped load's 64-stream phases (8.6 and 8.3 ms at depths 0
# and 1). Per token (a power of 1), depth 1 was priced 36 ms a decode step from a depth-0 spell at 64 rows where
# its steps took 22-28, and the stepped load's HIGH phases ran depth 0 for 94% of their steps where k1 served 7%
# more there; at 0.5 still 33-34 ms where they took 26. At 0.25 (the forty-third session) the stepped load
# served 1.031 of k1 by the median of six rounds (its HIGH phases at depth 1, 1.10 the tokens a second of 0.5's
# traced), but a shallower depth priced from a deeper spell looked dearer than it is, and at 16 streams the
# policy stayed at depth 1 in four visits of seven (87-94% of rows; side by side over three rounds 0.955 of k0
# against 0.970 at 0.5, whose visits ran depth 1 for 38%, 15% and 1%). Kept at 0.5. Tried at 0.25 again once
# attention was priced per key (the fifty-second session, the curves right by depth): 0.995 of 0.5 under the
# stepped load and 0.988 at 16 and 64 streams on code, side by side. Kept at 0.5.
TOKENS_POWER = 0.5


class Regime:
    """One cell's spell: the depth most of its first STEPS // 2 decode steps ran, then the last depth that ran
    more than half of its last STEPS (None before); the share of what serving adds that is the device thread
    slowed down; and per depth, what serving added to its settled steps (those whose last STEPS steps all ran
    it), while recent.

    NOTE: more than half, so that a probe ends inside the spell it interrupts: with the depth most of the last
    STEPS ran, a 16-step probe's last step tied 16 to 16, the tie went to the depth the cell ran first, and for
    that step the probe's depth was the spell (its own price, not the spell's, priced the depth in use)."""

    # NOTE: twice ServingExtra.MIN_SAMPLES: a probe that short never becomes the spell. A seek (spec_seek.SEEK_STEPS)
    # does, and leaves a settled mean for its depth; the depth in use has one from its own spell.
    STEPS = 32
    SHARE_WEIGHT = 0.02  # of a step, for the slowed share: as ServingExtra.WEIGHT
    # NOTE: a depth's settled mean (`settled`) prices it for this many of the cell's decode steps after its
    # last settled step, and needs this many settled steps first (as ServingExtra.STALE_STEPS, MIN_SAMPLES)
    SETTLED_STALE_STEPS = 1000
    SETTLED_MIN_STEPS = 16

    def __init__(self) -> None:
        self._recent: deque[int] = deque(maxlen=self.STEPS)
        self._counts: dict[int, int] = {}
        self._spell: int | None = None
        self._extra = 0.0  # running means of what serving adds and of the device thread's part of it
        self._slowed = 0.0
        self._steps = 0
        self._settled: dict[int, float] = {}  # by depth: the running mean of what serving added to its settled steps
        self._settled_var: dict[int, float] = {}  # the spread of its settled steps about that mean
        self._settled_count: dict[int, int] = {}
        self._settled_at: dict[int, int] = {}  # `_steps` at its last settled step

    @property
    def depth(self) -> int | None:
        return self._spell

    def ran(self, depth: int, extra: float | None = None) -> None:
        """A decode step of the cell ran at `depth` (`extra`: its period less the curves, if measured)."""
        if extra is not None and self._counts.get(depth) == self.STEPS:
            self._observe_settled(depth, extra)
        if len(self._recent) == self.STEPS:
            gone = self._recent[0]
            self._counts[gone] -= 1
        self._recent.append(depth)
        count = self._counts[depth] = self._counts.get(depth, 0) + 1
        if self._spell is None:
            if len(self._recent) >= self.STEPS // 2:
                self._spell = max(self._counts, key=self._counts.__getitem__)
        elif 2 * count > len(self._recent):  # NOTE: only the depth that just ran can have come to a majority
            self._spell = depth

    def _observe_settled(self, depth: int, extra: float) -> None:
        """A step at `depth` whose last STEPS steps all ran it: what serving added, into the depth's settled mean
        (afresh if that had gone stale)."""
        if not self._settled_recent(depth):
            self.restart(depth)
        count = self._settled_count[depth] = self._settled_count.get(depth, 0) + 1
        self._settled[depth], self._settled_var[depth] = moments(
            self._settled.get(depth, extra), self._settled_var.get(depth, 0.0), count, extra, self.SHARE_WEIGHT)
        self._settled_at[depth] = self._steps

    def restart(self, depth: int) -> None:
        """The depth's settled mean starts afresh from its next settled step."""
        self._settled_count[depth] = 0

    def _settled_recent(self, depth: int) -> bool:
        at = self._settled_at.get(depth)
        return at is not None and self._steps - at <= self.SETTLED_STALE_STEPS

    def settled(self, depth: int) -> float | None:
        """What serving added to this depth's decode steps in spells of its own, once the host had settled to
        them (the cell's last STEPS steps all at this depth), while recent; else None."""
        if self._settled_count.get(depth, 0) < self.SETTLED_MIN_STEPS or not self._settled_recent(depth):
            return None
        return self._settled[depth]

    def settled_steps(self, depth: int) -> int:
        """The settled steps this depth's settled mean holds while it is recent (0 where it has none)."""
        return self._settled_count.get(depth, 0) if self._settled_recent(depth) else 0

    def settled_error(self, depth: int) -> float:
        """The standard error of the depth's settled mean (as `settled`: 0 where there is none)."""
        if self.settled(depth) is None:
            return 0.0
        return standard_error(self._settled_var[depth], self._settled_count[depth], self.SHARE_WEIGHT)

    def observe_share(self, extra: float, slowed: float) -> None:
        """A decode step's extra (period less the curves) and the device thread's part of it (its own time
        less the curves)."""
        self._steps += 1
        weight = max(1.0 / self._steps, self.SHARE_WEIGHT)
        self._extra += weight * (extra - self._extra)
        self._slowed += weight * (slowed - self._slowed)

    @property
    def slowed_share(self) -> float:
        """The device thread's share of what serving adds, in [0, 1] (0 while the device's time is unknown)."""
        if self._extra <= 0.0:
            return 0.0
        return min(max(self._slowed / self._extra, 0.0), 1.0)


def moments(mean: float, var: float, count: int, value: float, weight: float) -> tuple[float, float]:
    """A running mean and the spread of its values about it after `value`, its `count`-th since it (re)started:
    a plain mean at first, then one that follows its last ~1/weight values."""
    weight = max(1.0 / count, weight)
    deviation = value - mean
    return mean + weight * deviation, (1.0 - weight) * (var + weight * deviation * deviation)


def standard_error(var: float, count: int, weight: float) -> float:
    """The standard error of a `moments` mean of `count` values: their spread over the values it holds (at most
    2 / weight - 1 of them)."""
    return math.sqrt(var / min(count, 2.0 / weight - 1.0))
