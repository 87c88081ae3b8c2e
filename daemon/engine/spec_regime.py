"""The spell a cell of decode steps is in (spec_extra.py): the depth most of its last steps ran, for each other
depth what its few steps among them added beyond that depth's mean, and how much of what serving adds is the
device thread itself running slower than the profile's curves.

On this host what serving adds to a decode step is mostly the device thread slowed down (its own time, 15.9
ms against the curves' 8.1 at 64 rows on code; the period only ~0.1 ms more than that): the HTTP process and
the clients stream the spell's tokens on the same cores. That share follows the spell the step runs in more
than the step's own depth. At 64 streams on code, depth-1 steps inside depth-0 spells added 7.2-10.3 ms and
depth-1 steps in their own spells 8.8-12.0; depth-0 steps inside depth-1 spells 9.6-11.4 against 8.0-8.4 in
their own (four instances). Priced by those few steps (the policy's probes), the depth in use kept winning
its comparisons: at 16 streams one instance served depth 1 for 69% of rows where k0 served 9% more than k1.

So a depth not in use is priced, for the slowed share, by the spell's extra per emitted token times its own
tokens, plus what its probes added beyond the spell's mean (what the depth itself costs that the curves do not
see); the rest (time between steps, which the host's work per step makes, as on a GPU host) as before, by
each depth's own mean (spec_extra.ServingExtra.priced).
"""

from __future__ import annotations

from collections import deque


class Regime:
    """One cell's spell: the depth most of its last STEPS decode steps ran (None until it has STEPS // 2), and
    the share of what serving adds that is the device thread slowed down."""

    STEPS = 32  # NOTE: twice a probe (ServingExtra.MIN_SAMPLES): a probe never becomes the spell
    SHARE_WEIGHT = 0.02  # of a step, for the slowed share: as ServingExtra.WEIGHT

    def __init__(self) -> None:
        self._recent: deque[int] = deque(maxlen=self.STEPS)
        self._counts: dict[int, int] = {}
        self._extra = 0.0  # running means of what serving adds and of the device thread's part of it
        self._slowed = 0.0
        self._steps = 0

    @property
    def depth(self) -> int | None:
        if len(self._recent) < self.STEPS // 2:
            return None
        return max(self._counts, key=self._counts.__getitem__)

    def ran(self, depth: int) -> None:
        """A decode step of the cell ran at `depth`."""
        if len(self._recent) == self.STEPS:
            gone = self._recent[0]
            self._counts[gone] -= 1
        self._recent.append(depth)
        self._counts[depth] = self._counts.get(depth, 0) + 1

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
