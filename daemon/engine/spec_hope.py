"""Which new requests hope: where the instance doubts a depth, one new request in `every` starts from the
first prior there (spec_stats.SlotAcceptance.rates), drafts alone if it must, and its windows say whether
acceptance came back (speculation.py says why the policy needs that).

A hope that leaves the instance doubting the same depth at the next hope failed, and the interval doubles
(up to MAX_EVERY); any other outcome (the doubt lifted, moved, or nothing is doubted) brings it back to
EVERY.

NOTE: at four streams on random words (T = 1.5), where nothing is ever accepted, one request in 16 hoping
cost ~1% of the throughput: its windows were rejected, and the depth it drafted also ran over its
neighbours' prompt chunks. Doubled after each failure, 160 requests hold 5 hopes instead of 10, and a
longer run of them one in 128. A load whose acceptance comes back is found within 128 requests at worst,
or sooner by the instance's fade (spec_learning.FADE).
"""

from __future__ import annotations

import numpy as np

EVERY = 16
MAX_EVERY = 128


class Hopes:
    def __init__(self) -> None:
        self.every = EVERY
        self._admitted = 0  # requests that took a slot
        self._next = 0  # the serial of the next hopeful one
        self._doubt: int | None = None  # the depth the instance doubted at the last hope

    def admit(self, count: int, doubt: int, max_depth: int) -> np.ndarray:
        """[count] whether each of `count` new requests hopes, the instance doubting depth index `doubt`
        (`spec_stats.first_doubt`; `max_depth` where it doubts none)."""
        hopeful = np.zeros(count, bool)
        for i in range(count):
            if self._admitted >= self._next:
                hopeful[i] = True
                self._next = self._admitted + self._interval(doubt, max_depth)
            self._admitted += 1
        return hopeful

    def _interval(self, doubt: int, max_depth: int) -> int:
        failed = doubt < max_depth and doubt == self._doubt
        self.every = min(2 * self.every, MAX_EVERY) if failed else EVERY
        self._doubt = doubt
        return self.every
