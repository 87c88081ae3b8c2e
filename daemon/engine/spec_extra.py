"""What serving adds to the device's time for a step (the second layer of the step-time model, spec_cost.py):
the host loop, the HTTP process and any client share the cores with the device.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from typing import TypeVar

from mtpserve.engine.spec_regime import TOKENS_POWER, Regime, moments, standard_error


class ServingExtra:
    """What serving adds to the device time of a step, by the rows that emit (half octaves), apart for
    steps with a prefill chunk and without, and for each depth a step ran: a running mean of the step's
    period less the device time the curves give for that very step.

    A depth is priced with its own mean at these rows while it is recent (its last step here no more than
    STALE_STEPS of this cell's steps ago, or fewer for a mean of few steps: YOUNG_STEPS), else with the mean
    of every depth's steps at the nearest rows measured (mostly the depth in use's); a depth run again after
    that starts its own mean afresh.

    NOTE: the host's work per step, the HTTP process and the clients share the cores with the device. Added,
    not scaled: a period-to-device ratio differed 2x between steps with a prompt chunk and without, and
    carried to a deeper depth it charged that depth for contention it does not cause. Depths run in turn
    in one process (step_trace's schedule) added about as much as each other to a decode step: 0.45, 0.50
    and 0.66 ms at depths 0-2 at 4 streams (1.8x, 1.4x and 1.3x their quiet cost), 4.5 and 4.7 ms at
    depths 0 and 1 at 64.

    NOTE: per depth, because the start-up profile's curves are what one launch measured: at 64 streams one
    launch priced depth 1's decode step at 2.4x depth 0's and the next at 3.0x (serving's steps: 1.8x).
    With one mean for every depth, learnt at the depth in use, that error stays in every other depth's
    price and decides the depth; a depth the policy has run is priced by what its own steps took.

    NOTE: recent only, because serving's share of the cores moves: a depth run for a few hundred steps at 4
    streams while a test ran beside the daemon learnt 2.3 ms, 3x the depth in use's 0.7 ms, and kept that
    price (and the policy off it) for the rest of the run. Forgotten after ~1,000 steps, a depth the curves
    favour is run again, for the ~MIN_SAMPLES steps its price takes, and priced by what it takes now.

    NOTE: apart for steps with a prefill chunk, because the two kinds miss in opposite directions. At 16
    streams on code, decode steps took 1.4 ms more than the quiet profile at depth 0 and at depth 1 alike,
    and steps with a prompt chunk 2-3 ms less (the profile's prefills carry no decode rows). One mean over
    both charged a decode step ~0.45 ms too little: 12% of a depth-0 step, 7% of a depth-1 step, enough to
    tip the choice to depth 0."""

    WEIGHT = 0.02  # of a step: a cell follows its last ~50 steps
    MIN_SAMPLES = 16
    STALE_STEPS = 1000
    # NOTE: a mean of few steps stays recent for YOUNG_STEPS of the cell's steps per step in it (and STALE_STEPS
    # at most). The first steps that serve are slow (at 4 streams on code, 1.35 ms more than the profile for
    # ~20 steps, against 0.45 a thousand steps on): a depth run only then kept that price for STALE_STEPS,
    # and the policy ran depth 2 for those 1,000 steps (a third of the run) where depth 1 was faster; four
    # fresh launches in two, and at the sweep's 160 prompts most of a visit.
    YOUNG_STEPS = 10
    # NOTE: a cell's first WARMUP_STEPS steps teach nothing: they are a load's first (a fresh instance's, or
    # the first at these rows), and slow. At 4 streams on code the first ~20-25 decode steps took 0.8-2.4 ms
    # more than the profile, 0.3-0.5 ms later (five fresh launches); learnt, they were depth 1's price when
    # the policy sought depth 2, which then ran for the ~230 steps that price lived (YOUNG_STEPS).
    # NOTE: they still count for the cell's spell (spec_regime.Regime.ran, without a price): the host runs the
    # depth that ran them. Left out of it, a depth's first spell at new rows settled only after 80 of its steps:
    # at 64 streams on code a fresh instance ran depth 0 for its first ~52 steps, which settled nothing, and
    # after a seek of depth 1 depth 0 was priced from depth 1's spell at 7.6 ms where its own steps had added 9.6;
    # the policy went back to depth 0, in one visit of three for 341 steps.
    WARMUP_STEPS = 32
    # NOTE: a depth left while its steps took more than they had (its mean more than RISE standard errors, and
    # RISE_SHARE of its step, over what it was PAST_STEPS of its steps before) is `suspect` until it runs
    # again: its price may be a passing burst's. It keeps that price, and the policy runs it for a few steps
    # to price it afresh where its mean from before the rise says it is worth it. At 64 streams on code, a
    # wave of new requests added ~3.5 ms to ~20-30 decode steps at depth 1 (~18% of a step); the policy left
    # depth 1 on that price and kept it for the STALE_STEPS it lived (replayed: depth 1 priced 12-18% of a
    # step too high). Priced by its mean from before the rise instead, a depth left at 4 streams, where the
    # host's level moves and stays, was priced 3-8% of a step too low on average.
    # NOTE: a suspect depth sought while the burst lasts gets a fresh mean of the burst, and is left again with
    # too short a past to compare: that leaving is compared with the mean from before the first rise, once.
    # On the tests' host, a 100-step burst outlasted a seek (SEEK_STEPS) and depth 1 kept the burst's price for
    # STALE_STEPS.
    # NOTE: a rise that outlasts that second seek too is compared once more, REVISIT_STEPS after the second
    # leaving (the third of SUSPECT_ROUNDS), not at once: a burst that outlasted two back-to-back seeks is likely
    # to outlast a third. On the tests' host a 200-step burst kept depth 1 (the best by ~9%) off for ~1,050 steps
    # after it had passed, and with the later seek ~300-350. (The bursts traced at 16 streams on code were shorter,
    # ~0.5 s: 16 depth-1 steps at 10-18 ms over the curves, ~5 usual; a seek outlasted them.)
    SUSPECT_ROUNDS = 3
    PAST_STEPS = 100
    RISE = 3.0  # NOTE: of the mean's own standard error: two readings of a noisy mean, each ~1 of them
    RISE_SHARE = 0.05  # NOTE: and of the step's period: a mean that creeps up as contexts grow is no burst
    # NOTE: a depth priced by a mean of its own whose last step here was more than REVISIT_STEPS of the cell's
    # steps ago is `aged`: the policy runs it again for a seek's steps where it is close to the depth in use
    # (spec_seek.py). At one stream on code a fresh instance ran depth 2 for its first 1.6 s, when its steps were
    # slow (1.85 ms over the curves in a 53-step spell), then depth 1; that price held depth 2 off (with its doubt
    # and the margin) until it went stale, 1,049 steps and 6.3 s of depth 1, whose steps emitted ~13% fewer tokens
    # a ms than depth 2's. The seek prices it afresh (`seek`), once in STALE_STEPS: a depth still not taken on its
    # new price is close to the best, and each seek costs its steps.
    # NOTE: however many steps the old price rests on: it is of another moment of the host. Renewed only where it
    # rested on fewer than 64 settled steps, at one stream on code (a traced instance, the host twice as fast as a
    # day before and moving by ~15% of a step within a second) depth 1 was sought and then kept for 496 and 257
    # steps on serving's fresh 0.41 ms against depth 2's 1.25 and depth 3's 1.43, learnt in long spells seconds
    # before; depth 1's steps emitted 9% fewer tokens a ms than either, and 26% of the visit's rows drafted one
    # token. A seek of depth 2 then priced it at 0.34-0.44 ms, and the policy kept it.
    REVISIT_STEPS = 250

    def __init__(self) -> None:
        self._mean: dict[tuple[bool, int], float] = {}  # every depth's steps
        self._count: dict[tuple[bool, int], int] = {}
        self._depth_mean: dict[tuple[bool, int, int], float] = {}  # each depth's own
        self._depth_var: dict[tuple[bool, int, int], float] = {}  # the spread of its steps about it
        self._depth_count: dict[tuple[bool, int, int], int] = {}
        self._depth_seen: dict[tuple[bool, int, int], int] = {}  # its cell's count at its last step
        self._sought: dict[tuple[bool, int, int], int] = {}  # a decode depth's cell count when `seek` ran it
        self._arrived: dict[tuple[bool, int], int] = {}  # a cell's steps, its warm-up included
        self._depth_past: dict[tuple[bool, int, int], deque[float]] = {}  # its own after each of its last steps
        self._last_depth: dict[tuple[bool, int], int] = {}  # the depth of a cell's last step
        self._suspect: dict[tuple[bool, int, int], float] = {}  # left on a rise, not run since: the mean before
        self._suspect_round: dict[tuple[bool, int, int], int] = {}  # 1: suspect on its full past, then on `_again`
        self._again: dict[tuple[bool, int, int], tuple[float, int]] = {}  # sought as suspect: the mean before, round
        self._due: dict[tuple[bool, int, int], int] = {}  # suspect in the last round: the cell's count it is due at
        self._depth_period: dict[tuple[bool, int, int], float] = {}  # the period of its last step
        self._regimes: dict[int, Regime] = {}  # decode steps' spell, by cell

    @staticmethod
    def bucket(num_emitting: int) -> int:
        """The half octave of rows a count of emitting rows is in (looked up: several calls a step)."""
        if num_emitting < len(_BUCKETS):
            return _BUCKETS[num_emitting]
        return round(2 * math.log2(num_emitting))

    def observe(self, num_emitting: int, seconds: float, device: float, has_prefill: bool = False,
                depth: int = 0, device_thread: float | None = None) -> None:
        """A step's period and the curves' device time for it (`device_thread`: the device thread's own
        time for it, where measured)."""
        key, extra = (has_prefill, self.bucket(num_emitting)), seconds - device
        arrived = self._arrived[key] = self._arrived.get(key, 0) + 1
        if arrived <= self.WARMUP_STEPS:
            if not has_prefill:
                self._regime(key[1]).ran(depth)
            return
        _update(self._mean, self._count, key, extra, self.WEIGHT)
        if not has_prefill:
            self._in_spell(key[1], depth, extra, 0.0 if device_thread is None else device_thread - device)
        own = (*key, depth)
        self._leave(key, depth)
        self._suspect.pop(own, None)
        self._suspect_round.pop(own, None)
        if not self._is_recent(own):
            self._restart(own)
        count = self._depth_count[own] = self._depth_count.get(own, 0) + 1
        self._depth_mean[own], self._depth_var[own] = moments(
            self._depth_mean.get(own, extra), self._depth_var.get(own, 0.0), count, extra, self.WEIGHT)
        self._depth_past[own].append(self._depth_mean[own])
        self._depth_period[own] = seconds
        self._depth_seen[own] = self._count[key]

    def _in_spell(self, cell: int, depth: int, extra: float, slowed: float) -> None:
        """A decode step at `depth` in this cell (`slowed`: the device thread's part of its extra)."""
        regime = self._regime(cell)
        regime.observe_share(extra, slowed)
        regime.ran(depth, extra)

    def _regime(self, cell: int) -> Regime:
        regime = self._regimes.get(cell)
        if regime is None:
            regime = self._regimes[cell] = Regime()
        return regime

    def priced(self, num_emitting: int, depth: int, tokens: Callable[[int], float]) -> float:
        """What serving adds to a decode step at this depth and these rows as the policy prices it (`tokens`:
        a step's expected emitted tokens by depth): by what serving added in the depth's own settled spells where
        they are recent (spec_regime.Regime.settled); else as `seconds` prices it, but for a depth other than the
        spell's the device thread's slowed share is the spell depth's own mean scaled by
        the ratio of the depth's tokens to the spell depth's, to TOKENS_POWER (`lender`). Never below 0."""
        own = self.seconds(num_emitting, depth=depth)
        cell = self.bucket(num_emitting)
        regime = self._regimes.get(cell)
        settled = regime.settled(depth) if regime is not None else None
        if settled is not None:
            return max(settled, 0.0)
        spell = self.lender(num_emitting, depth)
        if regime is None or spell is None:
            return own
        scale = (tokens(depth) / max(tokens(spell), 1e-9)) ** TOKENS_POWER
        share = regime.slowed_share
        return (1.0 - share) * own + share * max(self._depth_mean[(False, cell, spell)], 0.0) * scale

    def lender(self, num_emitting: int, depth: int) -> int | None:
        """The spell's depth where `priced` prices this depth's decode steps at these rows partly from its mean
        (the depth has no recent settled mean, the spell is another depth's, and the device thread is slowed in
        it), else None."""
        regime = self._regimes.get(self.bucket(num_emitting))
        if regime is None or regime.settled(depth) is not None or regime.slowed_share <= 0.0:
            return None
        spell = regime.depth
        if spell is None or spell == depth or not self._has_own((False, self.bucket(num_emitting), spell)):
            return None
        return spell

    def _leave(self, key: tuple[bool, int], depth: int) -> None:
        """A step at `depth` in this cell: the depth its last step ran, if another, is left, and suspect if
        its mean had risen by more than RISE standard errors and RISE_SHARE of its step over its last
        PAST_STEPS steps."""
        last = self._last_depth.get(key)
        self._last_depth[key] = depth
        if last is None or last == depth:
            return
        left = (*key, last)
        past = self._depth_past.get(left)
        again = self._again.pop(left, None)
        if not self._has_own(left) or past is None:
            return
        if len(past) >= self.PAST_STEPS:
            before, round_ = past[0], 1
        elif again is not None:
            before, round_ = again[0], again[1] + 1
        else:
            return
        rise = self._depth_mean[left] - before
        if rise > self.RISE * self._standard_error(left) and rise > self.RISE_SHARE * self._depth_period[left]:
            self._suspect[left], self._suspect_round[left] = before, round_
            if round_ == self.SUSPECT_ROUNDS:
                self._due[left] = self._count[key] + self.REVISIT_STEPS
            else:
                self._due.pop(left, None)

    def suspect(self, num_emitting: int, depth: int) -> float | None:
        """Where decode steps at this depth and these rows are priced by a mean that had risen when the depth
        was left (a burst of host load as likely as not) and it has not run since, what it added before the
        rise (in the last of SUSPECT_ROUNDS, only from REVISIT_STEPS after that leaving); else None."""
        own = (False, self.bucket(num_emitting), depth)
        if not self._has_own(own) or self._count[own[:2]] < self._due.get(own, 0):
            return None
        return self._suspect.get(own)

    def _has_own(self, own: tuple[bool, int, int]) -> bool:
        """Whether a depth's own mean prices it: enough steps, and recent."""
        return self._depth_count.get(own, 0) >= self.MIN_SAMPLES and self._is_recent(own)

    def _is_recent(self, own: tuple[bool, int, int]) -> bool:
        """Whether a depth's last step here is recent: no more than STALE_STEPS of the cell's steps ago, or
        YOUNG_STEPS per step of its mean if that is fewer."""
        seen = self._depth_seen.get(own)
        if seen is None:
            return False
        return self._count[own[:2]] - seen <= min(self.STALE_STEPS, self.YOUNG_STEPS * self._depth_count[own])

    def seconds(self, num_emitting: int, has_prefill: bool = False, depth: int | None = None) -> float:
        """At these rows (and this depth, if its steps have been measured here), else at the nearest rows
        measured, else nothing yet; never below 0 (a quiet profile is the least a step costs)."""
        return max(self.measured(num_emitting, has_prefill, depth), 0.0)

    def measured(self, num_emitting: int, has_prefill: bool = False, depth: int | None = None) -> float:
        """The mean itself, which is below 0 where serving's steps were shorter than the profile's curves
        (a prefill chunk beside decode rows); for a kind of step not measured yet, a decode step's."""
        key = self.bucket(num_emitting)
        own = (has_prefill, key, depth if depth is not None else -1)
        if self._has_own(own):
            return self._depth_mean[own]
        known = [b for (kind, b), n in self._count.items() if kind == has_prefill and n >= self.MIN_SAMPLES]
        if not known:
            return self.measured(num_emitting, depth=depth) if has_prefill else 0.0
        return self._mean[(has_prefill, min(known, key=lambda b: abs(b - key)))]

    def uncertainty(self, num_emitting: int, depth: int) -> float:
        """The standard error of a decode depth's own mean at these rows (its steps' spread over the steps
        the mean holds, ~1/WEIGHT at most); 0 where it is priced with a borrowed one."""
        own = (False, self.bucket(num_emitting), depth)
        regime = self._regimes.get(own[1])
        if regime is not None and regime.settled(depth) is not None:  # NOTE: the mean `priced` prices it by
            return regime.settled_error(depth)
        return self._standard_error(own) if self._has_own(own) else 0.0

    def _standard_error(self, own: tuple[bool, int, int]) -> float:
        return standard_error(self._depth_var[own], self._depth_count[own], self.WEIGHT)

    def borrowed(self, num_emitting: int, depth: int, lender: int) -> bool:
        """Whether decode steps at this depth are priced here with a mean the `lender` depth taught: they
        have no recent mean of their own at these rows, the lender has, and this depth was not sought here
        (`seek`) within the last STALE_STEPS of the cell's steps."""
        key = (False, self.bucket(num_emitting))
        if self._has_own((*key, depth)) or not self._has_own((*key, lender)):
            return False
        sought = self._sought.get((*key, depth))
        return sought is None or self._count[key] - sought > self.STALE_STEPS

    def aged(self, num_emitting: int, depth: int) -> bool:
        """Whether decode steps at this depth and these rows are priced by a mean of their own that its steps last
        renewed more than REVISIT_STEPS of the cell's steps ago, and that no seek renewed in the last STALE_STEPS."""
        key = (False, self.bucket(num_emitting))
        own = (*key, depth)
        if not self._has_own(own):
            return False
        sought = self._sought.get(own)
        if sought is not None and self._count[key] - sought <= self.STALE_STEPS:
            return False
        return self._count[key] - self._depth_seen[own] > self.REVISIT_STEPS

    def seek(self, num_emitting: int, depth: int) -> None:
        """The policy runs this depth's decode steps at these rows to give it a mean of its own (afresh, if
        it is suspect or `aged`: a price from another moment of the host, which a seek's few steps would only
        dilute)."""
        key = (False, self.bucket(num_emitting))
        own = (*key, depth)
        aged = self.aged(num_emitting, depth)
        self._sought[own] = self._count.get(key, 0)
        before, round_ = self._suspect.pop(own, None), self._suspect_round.pop(own, 0)
        if before is not None or aged:
            self._restart(own)
            regime = self._regimes.get(key[1])
            if regime is not None:
                regime.restart(depth)
            if before is not None and round_ < self.SUSPECT_ROUNDS:
                self._again[own] = (before, round_)

    def _restart(self, own: tuple[bool, int, int]) -> None:
        """A plain mean again from the depth's next step, of what it takes now."""
        self._depth_count[own] = 0
        self._depth_past[own] = deque(maxlen=self.PAST_STEPS)

    def chunk_extra(self, num_emitting: int, depth: int) -> float:
        """What serving adds to a step with a prompt chunk beyond what it adds to a decode step, at these
        rows and depth: from this depth's own means when it has both kinds, else from every depth's.

        NOTE: from one source. Where a depth had its own decode mean and not yet its own chunk mean, the
        difference of `measured`'s two figures took the chunk steps of every depth less the decode steps
        of this one: this depth's own correction entered the prompts' share with the opposite sign to the
        one it has in the decode step's price."""
        key = self.bucket(num_emitting)
        mixed, decode = (True, key, depth), (False, key, depth)
        if self._has_own(mixed) and self._has_own(decode):
            return self._depth_mean[mixed] - self._depth_mean[decode]
        return self.measured(num_emitting, True) - self.measured(num_emitting)


_BUCKETS = tuple(round(2 * math.log2(max(n, 1))) for n in range(4097))
_Key = TypeVar("_Key", tuple[bool, int], tuple[bool, int, int])


def _update(means: dict[_Key, float], counts: dict[_Key, int], key: _Key, value: float, weight: float) -> None:
    """A running mean that starts as a plain mean and then follows its last ~1/weight samples."""
    count = counts[key] = counts.get(key, 0) + 1
    mean = means.get(key, value)
    means[key] = mean + max(1.0 / count, weight) * (value - mean)
