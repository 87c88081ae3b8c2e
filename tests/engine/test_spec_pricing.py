"""What the policy pays for what it decides: how it prices a step's attention (its prompt chunks:
test_spec_prompts.py), how a request that stopped drafting gets to draft again, and how often it decides at all
(docs/speculation.md)."""

import io

import numpy as np
import pytest
from mtpserve.engine.request import EngineRequest, Request
from mtpserve.engine.scheduler import SchedulePlan, ScheduledRow
from mtpserve.engine.spec_curve import Curve
from mtpserve.engine.spec_extra import ServingExtra
from mtpserve.engine.spec_policy import expected_tokens
from mtpserve.engine.spec_hold import HOLD_STEPS, MAX_HOLD_STEPS
from mtpserve.engine.speculation import Speculation
from mtpserve.engine.step_plan import StepTiming
from mtpserve.engine.step_trace import StepTrace
from mtpserve.ipc.sampling_params import SamplingParams
from spec_device import device_ms, memory_bound_ms, one_row, profiled, rows_of
from spec_rows import K, decode_row


@pytest.fixture(autouse=True)
def steady(monkeypatch):
    """These tests price a steady load: what serving adds is learnt from its first step."""
    monkeypatch.setattr(ServingExtra, "WARMUP_STEPS", 0)


def test_a_wide_window_pays_for_its_attention_per_query_token():
    """At one row and 0.9 acceptance, one draft is best after 300 tokens of context, where each window
    token's attention costs more than a deeper draft is worth; after 32 tokens deeper windows pay. Counting
    a row's context once, whatever its window, priced the depth-3 step low and chose 3 after 300 tokens."""
    spec = profiled(0.9)
    gain = expected_tokens(np.full((1, K), 0.9))[0]
    best = {kv: max(range(K + 1), key=lambda d: gain[d] / sum(device_ms(d + 1, kv, d))) for kv in (32, 300)}
    assert best == {32: K, 300: 1}
    spec._depth = 0
    assert spec.choose(one_row(300, K + 1)).tolist() == [1]
    spec._held = None
    spec._by_rows.clear()  # NOTE: no decision to resume either: a new one at the new context
    assert spec.choose(one_row(32, K + 1))[0] > 1


def test_a_memory_bound_depth_0_is_priced_at_many_rows_the_profile_never_ran():
    """At 64 rows of 360 positions, accepting 0.9, depth 1 serves 7% more than depth 0 on a device whose
    attention is mostly reading keys. Profiled as the start-up profile does (long contexts up to 16 rows),
    the policy drafts one. Priced per (query, key) pair alone, depth 0 came out 32% cheap there and the
    policy drafted nothing."""
    spec = Speculation(K, adaptive=True, num_slots=64)
    for rows, kv in [(rows, kv) for rows in (1, 4, 16) for kv in (32, 384)] + [(64, 32)]:
        for depth in range(K + 1):
            load = spec.shape(rows_of(rows, kv, depth + 1), np.full(rows, depth))
            target, drafts = memory_bound_ms(rows, kv, depth)
            for noise in (1.0, 1.1, 1.3):  # NOTE: other work on the host only ever adds time
                spec.costs.observe(load, 0.0, StepTiming(target * noise * 1e-3, drafts * noise * 1e-3))
    spec.costs.freeze()
    spec.instance.whole.tried[:] = spec.requests.tried[:] = 1000.0
    spec.instance.whole.accepted[:] = spec.requests.accepted[:] = 900.0
    gain = expected_tokens(np.full((1, K), 0.9))[0]
    rate = [64 * gain[d] / sum(memory_bound_ms(64, 360, d)) for d in range(K + 1)]
    assert max(range(K + 1), key=rate.__getitem__) == 1 and rate[1] / rate[0] > 1.05
    assert spec.choose(rows_of(64, 360, K + 1)).tolist() == [1] * 64


def test_a_request_that_stopped_drafting_on_a_few_unlucky_windows_drafts_again():
    """An instance that accepts 0.9, and a request whose first windows were all rejected: it stops
    drafting. Drafting nothing it would learn nothing and stay at k=0 all its life; its own evidence fades
    back to the instance's estimate instead, and it drafts again within a few decisions."""
    spec = profiled(0.9)
    spec.requests.tried[0] = 4.0
    spec.requests.accepted[0] = 0.0
    plan = one_row(32, K + 1)
    spec._depth = 0
    assert spec.choose(plan).tolist() == [0]
    drafts = [int(spec.choose(plan)[0]) for _ in range(4 * HOLD_STEPS)]
    assert drafts[-1] >= 1


def test_a_request_cut_short_by_a_few_rejections_drafts_deeper_again():
    """An instance that accepts 0.9 at every depth, and a request whose second drafts were rejected a few
    times: it drafts one. Drafting one it never tries a second and would keep its doubt all its life; its
    evidence at the depths it doubts more than the instance fades with the steps instead, and it drafts
    deeper again within a few holds (its windows now all accepted)."""
    spec = profiled(0.9)
    spec.requests.tried[0] = [1000.0, 6.0, 0.0]
    spec.requests.accepted[0] = [900.0, 0.0, 0.0]
    plan = one_row(32, K + 1)
    assert spec.choose(plan).tolist() == [1]
    drafts = []
    for _ in range(8 * HOLD_STEPS):
        drafts.append(k := int(spec.choose(plan)[0]))
        spec.observe_windows(np.array([0]), np.array([k]), np.array([k]), complete=np.array([K]))
    assert drafts[0] == 1 and drafts[-1] >= 2


def test_a_request_keeps_what_it_learnt_of_a_depth_beyond_its_drafts_where_it_beats_the_instance():
    """A request capped at one draft whose depth-2 evidence is better than the instance's keeps it, however
    long it drafts one (faded back, it would price that depth as the instance does)."""
    spec = profiled(0.5)
    plan = one_row(32, 2)
    request = plan.rows[0].request
    request.params, request.slot = SamplingParams(temperature=0.0, max_draft_tokens=1), 0
    spec.requests.tried[0] = [100.0, 20.0, 0.0]
    spec.requests.accepted[0] = [90.0, 19.0, 0.0]
    before = spec.requests.counts[0].copy()
    spec.choose(SchedulePlan(plan.rows, (request,), (), ()))
    spec.requests.counts[0] = before  # NOTE: taking the slot reset it
    for _ in range(8 * HOLD_STEPS):
        assert spec.choose(plan).tolist() == [1]
    assert spec.requests.counts[0, :, 1].tolist() == before[:, 1].tolist()
    assert spec.requests.counts[0, 1, 2] == 0.0


def test_a_decision_repeated_at_a_steady_load_holds_longer():
    """At a steady load the policy decides again after HOLD_STEPS, then after twice as many steps each time
    it decides the same, up to MAX_HOLD_STEPS: deciding costs Python the step's thread waits for. A change
    in the rows that emit ends the hold at once."""
    spec = profiled(0.9)
    out = io.StringIO()
    spec.trace = StepTrace(out)
    rows = tuple(decode_row(i) for i in range(4))
    for row in rows:
        row.request.slot = row.slot
    steady = SchedulePlan(rows, (), (), ())
    for _ in range(1000):
        spec.choose(steady)
    decisions = out.getvalue().count("#d ")
    expected = 0
    steps, length = 0, HOLD_STEPS
    while steps < 1000:
        expected, steps, length = expected + 1, steps + length, min(2 * length, MAX_HOLD_STEPS)
    assert decisions == expected
    spec.choose(SchedulePlan(rows[:3], (), (), ()))
    assert out.getvalue().count("#d ") == decisions + 1


def emitting_plan(num_rows: int, chunks: int, window: int = K + 1, kv: int = 300) -> SchedulePlan:
    """`num_rows` rows after `kv` tokens of KV, of which the last `chunks` prefill a middle chunk (they do
    not emit) and the others verify a window of `window` tokens."""
    rows = []
    for i in range(num_rows):
        request = Request(EngineRequest(i, (1, 2, 3), SamplingParams(temperature=0.0)), i, 0)
        request.num_kv_tokens = kv
        prefill = i >= num_rows - chunks
        rows.append(ScheduledRow(request, 0, i, prefill, 64 if prefill else window, 0, not prefill))
    return SchedulePlan(tuple(rows), (), (), ())


def test_a_decision_holds_while_the_rows_that_emit_stay_in_the_same_half_octave():
    """At 64 streams the rows that emit change almost every step (a prompt's middle chunk does not emit,
    its last one does); a decision each time was most of the policy's host work. A decision made at 64
    rows holds while 57-64 emit, and a step to 32 rows ends it at once."""
    spec = Speculation(K, adaptive=True, num_slots=64)
    out = io.StringIO()
    spec.trace = StepTrace(out)
    spec.choose(emitting_plan(64, 0))
    assert out.getvalue().count("#d ") == 1
    for step in range(HOLD_STEPS - 1):
        spec.choose(emitting_plan(64, step % 8))  # 57-64 rows emit
    assert out.getvalue().count("#d ") == 1
    spec.choose(emitting_plan(64, 32))
    assert out.getvalue().count("#d ") == 2


def test_a_decision_at_these_rows_holds_again_when_the_rows_come_back_to_them():
    """At four streams the rows that emit go 4, 3, 4 as a request ends and a new one prefills; each change
    ends the hold. The last decision at 4 rows holds again on the way back (and the one at 3 rows too), until
    its steps run out; after a long spell at other rows it does not."""
    spec = Speculation(K, adaptive=True, num_slots=64)
    out = io.StringIO()
    spec.trace = StepTrace(out)
    for step in range(1200):
        spec.choose(emitting_plan(4, int(step % 6 == 5)))  # one step in six, a row prefills a middle chunk
    decisions = out.getvalue().count("#d ")
    assert decisions <= 2 * (1200 // MAX_HOLD_STEPS + 6)  # each row count's decisions double up to the cap
    for _ in range(3 * MAX_HOLD_STEPS):
        spec.choose(emitting_plan(32, 0))
    before = out.getvalue().count("#d ")
    spec.choose(emitting_plan(4, 0))
    assert out.getvalue().count("#d ") == before + 1


def sixty_four_rows(acceptance: float) -> Speculation:
    """A policy for 64 rows on a device where a decode step takes 10 ms plus 0.5 ms a draft slot of the
    window plus 3 ms a depth, whose requests and instance accept `acceptance` at every depth."""
    spec = Speculation(K, adaptive=True, num_slots=64)
    for kv in (32, 384):
        for depth in range(K + 1):
            load = spec.shape(emitting_plan(64, 0, depth + 1, kv), np.full(64, depth))
            target, drafts = 10e-3 + 0.5e-3 * depth, 3e-3 * depth
            for _ in range(Curve.MIN_SAMPLES):
                spec.costs.observe(load, target + drafts, StepTiming(target, drafts))
    spec.costs.freeze()
    spec.instance.whole.tried[:] = spec.requests.tried[:] = 1000.0
    spec.instance.whole.accepted[:] = spec.requests.accepted[:] = 1000.0 * acceptance
    return spec


@pytest.mark.parametrize("acceptance, clear", [(0.02, True), (0.3, False)])
def test_a_clear_decision_holds_longer_while_the_rows_that_emit_stay_in_the_same_half_octave(acceptance, clear):
    """64 rows (`sixty_four_rows`), 58-64 of them emitting, never as many at a decision as at the one before.
    Where nothing is accepted (0.02) depth 0 beats depth 1 by a third, and the decision holds twice as long
    each time it repeats, up to MAX_HOLD_STEPS (a decision every HOLD_STEPS was half the policy's host work
    at 64 streams drafting nothing). At 0.3, depth 0 beats depth 1 by ~4%, within the switch margin: it
    holds HOLD_STEPS, as a marginal choice must (held longer, one such at 16 rows cost 9%)."""
    spec = sixty_four_rows(acceptance)
    out = io.StringIO()
    spec.trace = StepTrace(out)
    for step in range(1000):
        assert spec.choose(emitting_plan(64, step % 7)).max() == 0  # 58-64 rows emit
    decisions = out.getvalue().count("#d ")
    if clear:
        assert decisions <= 1000 // MAX_HOLD_STEPS + 5
    else:
        assert decisions >= 1000 // HOLD_STEPS - 2


def test_under_a_held_decision_a_request_s_drafts_are_read_once_and_a_slot_s_new_request_afresh():
    """At 64 streams the rows change almost every step, and each held step read every row's estimate (half of
    the policy's host work a step): now a request's drafts are read the first step it runs under the decision.
    A request that has not been read yet is read from its estimate as it is then, and a new request that
    takes a slot is read afresh, not given the drafts of the request that left it."""
    spec = sixty_four_rows(0.9)
    depth = int(spec.choose(emitting_plan(64, 0)).max())
    assert depth >= 1
    spec.requests.tried[5], spec.requests.accepted[5] = 1000.0, 0.0  # slot 5's request: nothing accepted
    rows = emitting_plan(64, 1).rows  # NOTE: other rows than the decision's: its drafts are not the step's
    assert spec.choose(SchedulePlan(rows, (), (), ()))[5] == 0
    spec.requests.tried[5], spec.requests.accepted[5] = 1000.0, 900.0
    assert spec.choose(SchedulePlan(rows[1:], (), (), ()))[4] == 0  # slot 5 (row 4 here), read once: still 0
    newcomer = Request(EngineRequest(99, (1, 2, 3), SamplingParams(temperature=0.0)), 99, 0)
    newcomer.slot, newcomer.num_kv_tokens = 5, 300
    rows = tuple(ScheduledRow(newcomer, 0, 5, False, K + 1, 0, True) if row.slot == 5 else row for row in rows)
    assert spec.choose(SchedulePlan(rows, (newcomer,), (), ()))[5] == depth


def test_a_seeded_sample_drafts_its_cap_while_a_decision_for_depth_0_holds():
    """While a decision for depth 0 holds at 64 rows, every row drafts nothing by a short path; a seeded
    sample admitted meanwhile still drafts its cap in every step it is in, as its seed promises, and the
    others nothing."""
    spec = sixty_four_rows(0.02)
    first = emitting_plan(64, 0)
    for row in first.rows:
        row.request.slot = row.slot
    # NOTE: admitted as one step's inserts: hopes back off where nothing is accepted, and the 65th request
    # does not hope (a hope would end the hold)
    spec.choose(SchedulePlan(first.rows, tuple(row.request for row in first.rows), (), ()))
    for step in range(20):
        assert spec.choose(emitting_plan(64, step % 7)).max() == 0
    rows = list(emitting_plan(64, 0).rows)
    seeded = Request(EngineRequest(99, (1, 2, 3), SamplingParams(temperature=1.0, seed=7, max_draft_tokens=2)), 99, 0)
    seeded.slot = 5
    rows[5] = ScheduledRow(seeded, 0, 5, False, 3, 0, True)
    # NOTE: its drafts make the step run depth 2, so a row still hoping for depth 1 may draft there too
    hopeless = ~spec.requests.hopeful[:64]
    hopeless[5] = False
    for plan in (SchedulePlan(tuple(rows), (seeded,), (), ()), *[SchedulePlan(tuple(rows), (), (), ())] * 10):
        drafts = spec.choose(plan)
        assert drafts[5] == 2 and not drafts[hopeless].any()
