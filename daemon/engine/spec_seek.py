"""Where the speculation policy measures a price before trusting it (speculation.py): a depth next to the
chosen one is run for a few steps when its price is borrowed from the depth in use, was left on a burst, or rests
on a few steps from a while ago (what serving adds, spec_extra.py), and so is a depth switched to on a price the
spell's depth lent it; going deeper takes the deeper depth's price some standard errors high, since a few steps'
mean wanders by more than the switching margin.
"""

from __future__ import annotations

from collections.abc import Callable

from mtpserve.engine.spec_extra import ServingExtra
from mtpserve.engine.spec_policy import worth_pricing
from mtpserve.engine.spec_regime import Regime

# NOTE: a depth not run lately at these rows is priced with what serving adds to the depth in use's steps
# (spec_extra.py), and that can be off by more than the margin: at 64 streams on code (256-token prompts),
# serving's depth-0 steps took 9-10 ms more than the profile's curves (their KV, ~80 MB, no longer fits the
# cache; the profile's did) and depth-1 steps ~4 ms more (the curves already charge their second query
# per key, which a read from memory hides). Priced with depth 0's extra, depth 1 looked 3% worse and never
# ran; with the depths run in turn in one process, its decode steps emitted 11% more a second. A deeper
# depth within PRICE_BAND of the depth in use, with no recent price of its own, is run for a few steps
# (ServingExtra.MIN_SAMPLES) once in STALE_STEPS to get one. So is a shallower one: at 16 streams on code
# serving added more to a depth-1 decode step than to a depth-0 one (1.55 against 0.66 ms over a tried
# profile's curves, the depths run in turn in one process; docs/benchmarks.md), so depth 0 priced with
# depth 1's extra looked ~10% worse where k0 served 5% above k1, and an instance that reached depth 1 first
# kept it for the whole visit (two of three rounds; with the shallower probe, none: 1.02-1.06x the served
# tokens a second, side by side).
PRICE_BAND = 0.10
# NOTE: a seek runs its depth long enough for the host to settle to it and for a settled mean of its own
# (spec_regime.Regime.settled): what serving adds follows the spell a step runs in, not the step's depth. At 64
# streams on code (an AMD EPYC host), depth 1 was priced from depth 0's spell at 11.6 ms over the curves where
# its own spells added ~7.4 (depth 0's ~8.0): its decode steps emitted 16% more a second than depth 0's, run
# in turn in one process, and a 16-step seek left it priced 4.4 ms (15%) high; the policy ran depth 0 for
# 95-98% of rows and served 0.905 of k1.
SEEK_STEPS = Regime.STEPS + Regime.SETTLED_MIN_STEPS
# NOTE: going deeper takes a deeper depth's price DOUBT standard errors of its own mean high: a 16-step mean
# of what serving adds spread 0.40-0.49 ms (sd) about the rest of its spell at 4 streams on code (13-21% of a
# step), 0.56-0.88 ms at 64 (3-5%), where the margin is 5% and the depths differed by 2-9%.
DOUBT = 2.0


def depth_to_price(extra: ServingExtra, rates: dict[int, float], depth: int, num_emitting: int,
                   period: Callable[[int], float], added: Callable[[int], float], was: int) -> int | None:
    """A depth whose price is worth measuring now (`rates`: tokens per second by depth; `period`, `added`: a step's
    priced seconds by depth, and what serving adds in them), the chosen `depth` having been chosen over `was`:
    the chosen depth itself if it was switched to on a price the spell's depth lent it (ServingExtra.lender);
    else a depth next to it, within PRICE_BAND of it, if its price is borrowed from it (ServingExtra.borrowed)
    or rests on steps from a while ago (ServingExtra.aged), or if it was left on a rise and is within the
    band at what serving added to it before the rise (ServingExtra.suspect), the deeper first; None if none is.

    NOTE: the chosen depth, because a lent price goes when the spell turns to the depth, and its own mean from a
    spell just begun prices it then: on hosts of power 0, whenever the depth left had a settled mean and the
    other none, the policy went to the other on the lent price and back ~24 steps later, ~20 times in 1,000
    steps, neither spell settling (0.962-0.976 of the best fixed depth; run as a seek, one settled trip: 0.99)."""
    if depth != was and extra.lender(num_emitting, depth) is not None:
        return depth
    for other in (depth + 1, depth - 1):
        if worth_pricing(rates, depth, PRICE_BAND, other) and (
                extra.borrowed(num_emitting, other, depth) or extra.aged(num_emitting, other)):
            return other
    for other in (depth + 1, depth - 1):
        before = extra.suspect(num_emitting, other)
        if before is None or other not in rates:
            continue
        # NOTE: its rate had it added what it did before the rise (never below 0, as ServingExtra.seconds prices)
        rate = rates[other] * period(other) / max(period(other) - added(other) + max(before, 0.0), 1e-9)
        if worth_pricing({**rates, other: rate}, depth, PRICE_BAND, other):
            return other
    return None


def doubt_seconds(extra: ServingExtra, num_emitting: int, depth: int, current: int) -> float:
    """What a depth deeper than the one in use (`current`) has its price taken high by: DOUBT standard errors
    of its own mean."""
    return DOUBT * extra.uncertainty(num_emitting, depth) if depth > current else 0.0
