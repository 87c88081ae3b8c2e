"""Hopeful requests: how the policy tries drafting again where the instance doubts a depth, and what
the try may cost (docs/speculation.md)."""

import numpy as np

from mtpserve.engine.scheduler import SchedulePlan
from mtpserve.engine.spec_cost import Curve, StepLoad
from mtpserve.engine.speculation import HOLD_STEPS, HOPEFUL, Speculation
from mtpserve.engine.step_plan import StepTiming
from spec_rows import K, decode_row


def test_one_new_request_in_a_few_hopes_for_the_first_prior_and_the_rest_trust_the_instance():
    """Where drafts are rarely accepted, new requests do not draft, but one in HOPEFUL starts from the first
    prior at depth 1 (alone, it drafts, and its windows tell the instance whether acceptance came back).
    It drafts one deep: the deeper depths, never tried, are expected to accept no more than depth 1 does."""
    spec = Speculation(K, adaptive=True, num_slots=64)
    spec.costs.depth = Curve(prior=lambda n: 0.0)  # NOTE: a device with spare compute: drafting is cheap
    for _ in range(300):
        spec.instance.observe(np.array([K]), np.array([0]))
    drafted = new_requests_drafts(spec)
    assert drafted[0] == drafted[HOPEFUL] == 1 and sum(drafted) == 2
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
        spec.instance.observe(np.array([K]), np.array([0]))
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
        spec.instance.observe(np.array([K]), np.array([K]))
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
        spec.instance.observe(np.array([K]), np.array([1]))
    assert spec.instance.rates()[0] > 0.9 and spec.instance.rates()[1] < 0.1
    drafted = new_requests_drafts(spec)
    assert [i for i, k in enumerate(drafted) if k >= 2] == [0, HOPEFUL]
    assert all(k == 1 for i, k in enumerate(drafted) if i % HOPEFUL)


def new_requests_drafts(spec: Speculation) -> list[int]:
    """2 x HOPEFUL new requests, one at a time in 4 slots: the drafts each was given on arrival."""
    drafted = []
    for i in range(2 * HOPEFUL):
        row = decode_row(i % 4)
        row.request.slot = row.slot
        spec.choose(SchedulePlan((row,), (row.request,), (), ()))
        drafted.append(row.request.num_drafts)
    return drafted
