"""Hopeful requests: how the policy tries drafting again where the instance doubts a depth, and what
the try may cost (docs/speculation.md)."""

import numpy as np

from mtpserve.engine.scheduler import SchedulePlan
from mtpserve.engine.spec_cost import StepLoad
from mtpserve.engine.spec_curve import Curve
from mtpserve.engine.spec_hope import EVERY, MAX_EVERY, Hopes
from mtpserve.engine.spec_hold import HOLD_STEPS
from mtpserve.engine.speculation import Speculation
from mtpserve.engine.step_plan import StepTiming
from spec_rows import K, decode_row


def test_one_new_request_in_a_few_hopes_for_the_first_prior_and_the_rest_trust_the_instance():
    """Where drafts are rarely accepted, new requests do not draft, but one in EVERY starts from the first
    prior at depth 1 (alone, it drafts, and its windows tell the instance whether acceptance came back).
    It drafts one deep: the deeper depths, never tried, are expected to accept no more than depth 1 does."""
    spec = Speculation(K, adaptive=True, num_slots=64)
    spec.costs.depth = Curve(prior=lambda n: 0.0)  # NOTE: a device with spare compute: drafting is cheap
    for _ in range(300):
        spec.instance.whole.observe(np.array([K]), np.array([0]))
    drafted = new_requests_drafts(spec)
    assert drafted[0] == drafted[EVERY] == 1 and sum(drafted) == 2
    table = spec.requests  # the hopeful request's own windows soon outweigh its hope
    table.reset(np.array([0]), hopeful=True)
    for _ in range(3):
        table.observe(np.array([0]), np.array([K]), np.array([0]))
    assert table.rates(np.array([0]), spec.instance.rates())[0, 0] < 0.2


def test_a_hopeful_request_stops_drafting_as_soon_as_its_windows_are_rejected():
    """One row, a device where a first draft pays only above ~0.57 acceptance (the bundled model's periods at
    one row), an instance that doubts depth 1: the hopeful request drafts on its hope, and its first
    rejected window ends it (a decision held for HOLD_STEPS would have it draft eight)."""
    spec = Speculation(K, adaptive=True, num_slots=4)
    for depth, ms in enumerate([1.52, 2.38, 3.10, 3.90]):
        for _ in range(Curve.MIN_SAMPLES):
            spec.costs.observe(StepLoad(depth + 1, 1, 0, False), ms * 1e-3, StepTiming(ms * 1e-3, 0.0))
    spec.costs.depth = Curve(prior=lambda n: 0.0)
    for _ in range(300):
        spec.instance.whole.observe(np.array([K]), np.array([0]))
    row = decode_row(0)
    row.request.slot = row.slot
    windows = []
    for step in range(20):
        plan = SchedulePlan((row,), (row.request,) if step == 0 else (), (), ())
        k = int(spec.choose(plan)[0])
        windows.append(k)
        if k:
            spec.observe_windows(np.array([row.slot]), np.array([k]), np.array([0]), complete=np.array([k]))
    assert windows[0] == 1 and sum(windows) == 1


def test_a_hopeful_request_on_an_instance_that_doubts_nothing_leaves_the_decision_held():
    """Where every depth is trusted the hope changes nothing, so it costs no decisions: the step's decision
    holds as any other (deciding costs ~150 us of Python, and at 16 rows most steps have a hopeful row)."""
    spec = Speculation(K, adaptive=True, num_slots=4)
    spec.costs.depth = Curve(prior=lambda n: 0.0)
    for _ in range(300):
        spec.instance.whole.observe(np.array([K]), np.array([K]))
    row = decode_row(0)
    row.request.slot = row.slot
    assert spec.choose(SchedulePlan((row,), (row.request,), (), ()))[0] == K  # the first request is hopeful
    assert spec.requests.hopeful[row.slot] and spec._held is not None and spec._held.steps == HOLD_STEPS - 1


def test_a_hopeful_request_tries_the_first_depth_the_instance_doubts():
    """The instance trusts depth 1 and doubts depth 2 (one request's second drafts were all rejected): new
    requests draft one, and only a hopeful one tries a second, whose windows can teach the instance again
    (at depth 1 nothing would)."""
    spec = Speculation(K, adaptive=True, num_slots=64)
    spec.costs.depth = Curve(prior=lambda n: 0.0)  # NOTE: a device with spare compute: drafting is cheap
    for _ in range(300):
        spec.instance.whole.observe(np.array([K]), np.array([1]))
    assert spec.instance.rates()[0] > 0.9 and spec.instance.rates()[1] < 0.1
    drafted = new_requests_drafts(spec)
    assert [i for i, k in enumerate(drafted) if k >= 2] == [0, EVERY]
    assert all(k == 1 for i, k in enumerate(drafted) if i % EVERY)


def test_hopes_that_leave_the_same_depth_doubted_come_ever_more_rarely():
    """Where nothing is accepted, each hope fails: the interval doubles up to MAX_EVERY. Once the doubt lifts,
    the next hope brings it back to EVERY, and a new doubt is hoped against at that rate again."""
    hopes = Hopes()
    doubted = [i for i in range(1200) if hopes.admit(1, 0, K)[0]]
    gaps = np.diff(doubted).tolist()
    assert gaps[:4] == [EVERY, 2 * EVERY, 4 * EVERY, 8 * EVERY] and max(gaps) == min(gaps[4:]) == MAX_EVERY
    trusted = [i for i in range(300) if hopes.admit(1, K, K)[0]]  # nothing doubted: no hope fails
    assert np.diff(trusted).tolist() == [EVERY] * (len(trusted) - 1)
    again = [i for i in range(2 * EVERY + 1) if hopes.admit(1, 1, K)[0]]
    assert np.diff(again).tolist()[:1] == [EVERY]


def test_a_hope_that_moves_the_doubt_deeper_keeps_the_interval_short():
    """A hope whose windows taught the instance depth 1 again (it now doubts depth 2) succeeded: the next
    comes after EVERY requests, not twice that. Several requests taking slots in one step hope as one
    at a time would."""
    hopes = Hopes()
    first = hopes.admit(EVERY, 0, K)
    assert first.tolist() == [True] + [False] * (EVERY - 1)
    assert hopes.admit(EVERY, 1, K)[0] and hopes.every == EVERY
    assert hopes.admit(EVERY, 1, K)[0] and hopes.every == 2 * EVERY
    assert not hopes.admit(EVERY, 1, K).any()


def test_the_policy_stops_hoping_as_often_where_hopes_keep_failing():
    """Through `choose`: an instance that doubts depth 1 all along (every window rejected) gives hopes to
    requests 0, EVERY and 3 x EVERY of the first 4 x EVERY, where a fixed one in EVERY gave four."""
    spec = Speculation(K, adaptive=True, num_slots=64)
    spec.costs.depth = Curve(prior=lambda n: 0.0)  # NOTE: a device with spare compute: drafting is cheap
    for _ in range(300):
        spec.instance.whole.observe(np.array([K]), np.array([0]))
    drafted = new_requests_drafts(spec, 4 * EVERY)
    assert [i for i, k in enumerate(drafted) if k] == [0, EVERY, 3 * EVERY]


def new_requests_drafts(spec: Speculation, count: int = 2 * EVERY) -> list[int]:
    """`count` new requests, one at a time in 4 slots: the drafts each was given on arrival."""
    drafted = []
    for i in range(count):
        row = decode_row(i % 4)
        row.request.slot = row.slot
        spec.choose(SchedulePlan((row,), (row.request,), (), ()))
        drafted.append(row.request.num_drafts)
    return drafted
