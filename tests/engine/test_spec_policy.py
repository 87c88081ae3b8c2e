"""The speculation policy on synthetic costs and acceptance curves where the right answer is known."""

from typing import NamedTuple

import numpy as np
import pytest

from mtpserve.engine.spec_cost import StepLoad
from mtpserve.engine.spec_curve import Curve
from mtpserve.engine.spec_extra import ServingExtra
from mtpserve.engine.spec_policy import choose_depth, expected_tokens, row_drafts
from mtpserve.engine.request import EngineRequest, Request
from mtpserve.engine.scheduler import SchedulePlan, ScheduledRow
from mtpserve.engine.speculation import Speculation
from mtpserve.engine.step_plan import StepTiming
from mtpserve.ipc.sampling_params import SamplingParams
from spec_rows import K, decode_row


class StepCost(NamedTuple):
    """A synthetic device: seconds of a step, linear in what it computes."""

    base: float  # per step
    per_token: float  # per token of the target pass
    per_verify_row: float  # per row of target logits (rows x the widest window)
    per_depth: float  # per MTP depth run
    per_mtp_token: float  # per token of each MTP depth run

    def seconds(self, num_tokens: float, num_rows: int, width: int, depths: int) -> float:
        return (self.base + self.per_token * num_tokens + self.per_verify_row * num_rows * width
                + (self.per_depth + self.per_mtp_token * num_tokens) * depths)


# A device with spare compute: a step costs mostly its fixed part (a GPU at small batch).
SPARE = StepCost(base=10e-3, per_token=0.05e-3, per_verify_row=0.01e-3, per_depth=0.1e-3,
                 per_mtp_token=0.05e-3)
# A saturated device: every token costs as much as a whole step's fixed part.
LINEAR = StepCost(base=0.0, per_token=1e-3, per_verify_row=0.2e-3, per_depth=0.5e-3,
                  per_mtp_token=0.5e-3)


def rates(*per_row: float) -> np.ndarray:
    return np.array([[a] * K for a in per_row])


def caps(n: int, cap: int = K) -> np.ndarray:
    return np.full(n, cap, np.int64)


def decide(spec: Speculation, plan: SchedulePlan) -> None:
    """A decision of the policy on these decode rows (every one emits, each at its cap of K), held or not."""
    n = len(plan.rows)
    spec._policy(plan, np.array([row.slot for row in plan.rows], np.int64), np.ones(n, bool), caps(n))


def test_expected_tokens_counts_the_bonus_and_each_accepted_prefix():
    got = expected_tokens(np.array([[0.5, 0.5, 0.5]]))
    assert np.allclose(got, [[1.0, 1.5, 1.75, 1.875]])


def depth_for(acceptance: np.ndarray, cost: StepCost, current: int = 0, margin: float = 0.0) -> int:
    rows = acceptance.shape[0]
    period = lambda d: cost.seconds(rows * (d + 1), rows, d + 1, d)  # noqa: E731
    return choose_depth(expected_tokens(acceptance), caps(rows), np.zeros(rows, np.int64), period, current,
                        margin)


def test_batch_one_with_high_acceptance_drafts_the_maximum():
    assert depth_for(rates(0.9), SPARE) == K


def test_acceptance_near_zero_drafts_nothing():
    assert depth_for(rates(0.01), SPARE, current=K) == 0


def test_cost_linear_in_rows_drafts_nothing_at_a_large_batch():
    assert depth_for(rates(*[0.7] * 64), LINEAR, current=K) == 0


@pytest.mark.parametrize("batch", [1, 4, 16, 64])
def test_the_depth_is_the_best_uniform_k(batch):
    """Brute force over uniform k: with no margin the chosen depth's rate is the best of them."""
    gen = np.random.default_rng(batch)
    acceptance = gen.uniform(0.0, 1.0, (batch, K))
    for cost in (SPARE, LINEAR):
        chosen = depth_for(acceptance, cost)
        best = max(range(K + 1), key=lambda k: rate(acceptance, np.full(batch, k), cost))
        assert rate(acceptance, np.full(batch, chosen), cost) >= rate(acceptance, np.full(batch, best), cost)


def rate(acceptance: np.ndarray, drafts: np.ndarray, cost: StepCost) -> float:
    gain = expected_tokens(acceptance)[np.arange(len(drafts)), drafts].sum()
    width = int(drafts.max()) + 1
    return gain / cost.seconds(float((drafts + 1).sum()), len(drafts), width, int(drafts.max()))


def test_requests_that_differ_get_different_drafts():
    """At the step's depth, a request whose drafts are rarely accepted drafts less."""
    acceptance = rates(0.95, 0.95, 0.3, 0.02)
    got = row_drafts(acceptance, K, caps(4), np.zeros(4, np.int64), slot_cost=0.2)
    assert got.tolist() == [K, K, 1, 0]


def test_a_request_cap_and_floor_are_kept():
    got = row_drafts(rates(0.95, 0.01, 0.95), K, np.array([1, K, K]), np.array([0, 2, 0]), slot_cost=0.2)
    assert got.tolist() == [1, 2, K]


def test_an_oscillating_batch_switches_without_hysteresis_or_failure():
    """Around the switching point the choice follows the batch both ways, every time."""
    medium = StepCost(base=4e-3, per_token=0.4e-3, per_verify_row=0.05e-3, per_depth=0.2e-3,
                      per_mtp_token=0.15e-3)
    small = depth_for(rates(0.6), medium)
    choices = []
    for _ in range(20):
        choices.append(depth_for(rates(*[0.6] * 64), medium, current=choices[-1] if choices else 0))
        choices.append(depth_for(rates(0.6), medium, current=choices[-1]))
    assert small > 0 and choices[1::2] == [small] * 20 and choices[0::2] == [choices[0]] * 20
    assert choices[0] < small


def measured(periods_ms: list[float], rows: int) -> Speculation:
    """A policy whose decode steps of these rows at each depth took the given periods (all of it on the
    device, in the target pass)."""
    spec = Speculation(K, adaptive=True, num_slots=64)
    for depth, ms in enumerate(periods_ms):
        for _ in range(Curve.MIN_SAMPLES):
            spec.costs.observe(StepLoad(rows * (depth + 1), rows, 0, False), ms * 1e-3, StepTiming(ms * 1e-3, 0.0))
    spec.costs.depth = Curve(prior=lambda n: 0.0)
    return spec


def steady(periods_ms: list[float], rows: int, acceptance: float, current: int = 0,
           prefill_per_token: float = 0.0) -> int:
    """The depth a decode step gets when steps of these rows at each depth took the given periods (all
    of it on the device, in the target pass), and each emitted token brings `prefill_per_token` prompt
    tokens (a prompt token costs what a decode token costs, and runs every depth as well)."""
    spec = measured(periods_ms, rows)
    if prefill_per_token:
        per_token = (periods_ms[1] - periods_ms[0]) * 1e-3 / rows
        for n in range(rows, rows * (K + 1) + 512, 8):
            for _ in range(Curve.MIN_SAMPLES):
                seconds = (np.interp(n, [rows * (d + 1) for d in range(K + 1)], periods_ms) * 1e-3
                           if n <= rows * (K + 1) else periods_ms[-1] * 1e-3 + per_token * (n - rows * (K + 1)))
                spec.costs.mixed.observe(n, seconds)
                spec.costs.mixed_alone.observe(n, seconds)
                spec.costs.depth.observe(n, 0.3 * per_token * n)
        spec.traffic.chunk_tokens = 256.0
        for _ in range(100):  # finished requests of 128 tokens, each with its prompt
            spec.observe_finished(round(prefill_per_token * 128), 128)
    spec._depth = current
    plan = SchedulePlan(tuple(decode_row(i) for i in range(rows)), (), (), ())
    spec.requests.tried[:] = 100.0  # NOTE: 100 windows' worth of evidence at the given rate per depth
    spec.requests.accepted[:] = 100.0 * acceptance
    decide(spec, plan)
    return spec._depth


def test_a_steady_decode_load_takes_the_depth_its_measured_periods_favour():
    """The CPU figures of the bundled model at 1 and 4 rows (ms per step at depth 0..3), acceptance 0.85:
    drafting pays at 1 row, not at 4."""
    assert steady([1.52, 2.38, 3.10, 3.90], rows=1, acceptance=0.85) >= 2
    assert steady([2.29, 4.70, 6.40, 8.40], rows=4, acceptance=0.85) == 0


def test_prompts_that_run_every_depth_make_drafting_dearer():
    """16 rows where depth 1 just pays for decode steps; when each emitted token brings two prompt tokens,
    which each depth runs too, it does not."""
    periods = [4.0, 6.2, 9.0, 12.0]
    assert steady(periods, rows=16, acceptance=0.8) == 1
    assert steady(periods, rows=16, acceptance=0.8, prefill_per_token=2.0) == 0


def test_the_depth_in_use_is_kept_unless_a_deeper_one_is_clearly_better_or_a_shallower_one_is_best():
    """Going deeper leaves gaps in the new depths' MTP KV, so it needs a margin; going shallower does not."""
    gain = expected_tokens(rates(0.85))
    near = {0: 4.0, 1: 4.0 * gain[0, 1] / 1.02, 2: 20.0, 3: 30.0}  # depth 1 about 2% better than depth 0
    choose = lambda current: choose_depth(gain, caps(1), np.zeros(1, np.int64), near.__getitem__,  # noqa: E731
                                          current, margin=0.05)
    assert choose(0) == 0 and choose(1) == 1 and choose(3) == 1
    shallower = {**near, 1: 4.0 * gain[0, 1] * 1.02}  # depth 0 about 2% better than depth 1
    choose = lambda current: choose_depth(gain, caps(1), np.zeros(1, np.int64), shallower.__getitem__,  # noqa: E731
                                          current, margin=0.05)
    assert choose(1) == 0 and choose(0) == 0
    clear = {**near, 1: 4.0 * gain[0, 1] * 0.9}  # depth 1 about 10% better than depth 0
    choose = lambda current: choose_depth(gain, caps(1), np.zeros(1, np.int64), clear.__getitem__,  # noqa: E731
                                          current, margin=0.05)
    assert choose(0) == 1 and choose(1) == 1 and choose(3) == 1


def test_new_requests_are_priced_by_what_drafts_over_gapped_contexts_accept():
    """64 new requests (no windows of their own) on a device where depth 1 pays at acceptance 0.88 and not
    at the first prior's 0.7. Windows over contexts with gaps in their MTP KV (prompts prefilled at depth
    0) do not teach the instance's estimate, but they accept at least as well as whole ones would: when
    they accept 0.88, the new requests draft; when they accept 0.5, the instance's estimate from whole
    contexts (0.88) still prices them."""
    def depth(gapped: float, whole: float | None = None) -> int:
        spec, rng, slots = measured([17.5, 30.5, 60.0, 90.0], rows=64), np.random.default_rng(5), np.arange(64)
        for _ in range(30):
            for rate, complete in ((gapped, 0), (whole, 1)):
                if rate is not None:
                    accepted = (rng.random(64) < rate).astype(np.int64)
                    spec.observe_windows(slots, np.ones(64, np.int64), accepted, np.full(64, complete))
        spec.requests.reset(slots)
        decide(spec, SchedulePlan(tuple(decode_row(i) for i in range(64)), (), (), ()))
        return spec._depth

    assert depth(gapped=0.88) == 1
    assert depth(gapped=0.5, whole=0.88) == 1
    assert depth(gapped=0.5) == 0


def test_after_a_spell_of_no_drafting_the_instance_tries_again():
    """Acceptance near zero stops drafting; with nothing drafted nothing teaches the instance's estimate,
    which fades back towards the first prior, so drafting is tried again later."""
    spec = Speculation(K, adaptive=True, num_slots=64)
    for _ in range(300):
        spec.instance.whole.observe(np.array([K]), np.array([0]))
    assert spec.instance.rates()[0] < 0.05
    plan = SchedulePlan((decode_row(0),), (), (), ())
    assert spec.choose(plan).tolist() == [0]
    for _ in range(60_000):
        if spec.choose(plan).tolist() != [0]:
            break
    assert spec.choose(plan)[0] > 0 and spec.instance.rates()[0] > 0.3


def busy_host_depth(added_ms: float) -> tuple[int, Speculation]:
    """The depth at 64 rows after serving steps that took `added_ms` more than their quiet device time,
    on the bundled model's profile at 64 rows (acceptance 0.7 per depth)."""
    spec = Speculation(K, adaptive=True, num_slots=64)
    quiet = {64: 6.6, 128: 11.3, 192: 13.5, 256: 20.0}  # ms
    for n, ms in quiet.items():
        for _ in range(Curve.MIN_SAMPLES):
            spec.costs.observe(StepLoad(n, 64, 0, False), ms * 1e-3, StepTiming(ms * 1e-3, 0.0))
    spec.costs.depth = Curve(prior=lambda n: 0.03e-3 * n)
    spec.costs.freeze()
    for i in range(200):  # NOTE: steps differ in device time (as prompt chunks come and go)
        n = (64, 128, 192, 256)[i % 4]
        spec.observe(StepLoad(n, 64, 0, False, 64), (added_ms + quiet[n]) * 1e-3, None)
    plan = SchedulePlan(tuple(decode_row(i) for i in range(64)), (), (), ())
    spec.requests.tried[:] = 100.0
    spec.requests.accepted[:] = 70.0
    spec._depth = 0
    decide(spec, plan)
    return spec._depth, spec


def test_host_work_per_step_makes_drafting_pay():
    """The profile's device curves stay; serving measures what it adds to a step. On the quiet device 64
    rows do best without drafts; a host that adds 11 ms to every step makes drafting pay (fewer steps
    per token)."""
    quiet, _ = busy_host_depth(0.0)
    assert quiet == 0
    busy, spec = busy_host_depth(11.0)
    assert spec.extra.seconds(64) == pytest.approx(11e-3, rel=0.01)
    assert spec.costs.decode(64) == pytest.approx(6.6e-3)  # the profile's curve is kept
    assert busy >= 1
    assert spec.measured_seconds > 0 and spec.predicted_seconds > 0


def profiled(rows: int, target_ms: dict[int, float], depth_ms_per_token: float) -> Speculation:
    """A policy whose frozen profile has these rows' target pass take `target_ms` by tokens, and a depth
    `depth_ms_per_token` a token."""
    spec = Speculation(K, adaptive=True, num_slots=64)
    for n, ms in target_ms.items():
        for _ in range(Curve.MIN_SAMPLES):
            spec.costs.observe(StepLoad(n, rows, 0, False), ms * 1e-3, StepTiming(ms * 1e-3, 0.0))
    spec.costs.depth = Curve(prior=lambda n: depth_ms_per_token * 1e-3 * n)
    spec.costs.freeze()
    return spec


def test_a_depth_that_has_run_is_priced_by_what_its_own_steps_took():
    """Serving adds 1 ms to a depth-0 step of 64 rows and 10 ms to a depth-1 step (a launch whose profile
    priced depth 1 low). Once depth 1 has run, depth 0 is priced with its own 1 ms, not with the 10 ms
    learnt at the depth in use, and the policy goes back to it."""
    spec = profiled(64, {64: 6.6, 128: 11.3}, depth_ms_per_token=0.03)
    for depth, tokens, added_ms in ((0, 64, 1.0), (1, 128, 10.0)):
        load = StepLoad(tokens, 64, depth, False, 64)
        for _ in range(200):
            spec.observe(load, spec.costs.device(load) + added_ms * 1e-3, None)
    assert spec.extra.seconds(64, depth=0) == pytest.approx(1e-3)
    assert spec.extra.seconds(64, depth=1) == pytest.approx(10e-3, rel=0.01)
    assert spec.extra.seconds(64, depth=2) == pytest.approx(10e-3, rel=0.05)  # never ran: every depth's mean
    plan = SchedulePlan(tuple(decode_row(i) for i in range(64)), (), (), ())
    spec.requests.tried[:] = 100.0
    spec.requests.accepted[:] = 70.0
    spec._depth = 1
    decide(spec, plan)
    assert spec._depth == 0


def test_a_shallower_depth_priced_with_the_depth_in_use_s_extra_is_run_to_price_it():
    """16 rows at depth 1, where serving adds 0.8 ms to a step; depth 0 has never run here and borrows that,
    which puts it 9% behind. It is run for a few steps to price it, serving adds 0.2 ms to those, and the
    policy takes it (8% ahead). Priced only deeper, depth 0 never ran (16 streams on code: k0 served 5%
    above k1 while the policy kept depth 1)."""
    spec = profiled(16, {16: 3.2, 32: 4.8}, depth_ms_per_token=0.025)
    one = StepLoad(32, 16, 1, False, 16)
    for _ in range(200):
        spec.observe(one, spec.costs.device(one) + 0.8e-3, None)
    plan = SchedulePlan(tuple(decode_row(i) for i in range(16)), (), (), ())
    spec.requests.tried[:] = 100.0
    spec.requests.accepted[:] = 75.0
    spec._depth = 1
    decide(spec, plan)
    assert spec._depth == 1 and spec._held is not None and spec._held.depth == 0  # run to be priced
    zero = StepLoad(16, 16, 0, False, 16)
    for _ in range(ServingExtra.MIN_SAMPLES):
        spec.observe(zero, spec.costs.device(zero) + 0.2e-3, None)
    spec._held = None
    decide(spec, plan)
    assert spec._depth == 0


def test_the_traffic_means_start_at_their_first_sample_and_the_profile_leaves_none():
    """A first request of a 256-token prompt and 128 tokens out is the traffic at once (a mean starting at
    0 took ~20 requests to reach it, charging early prompts ~10x); the start-up profile's own prompts are
    then forgotten."""
    spec = Speculation(K, adaptive=True, num_slots=4)
    prompt = Request(EngineRequest(0, tuple(range(1, 257)), SamplingParams(temperature=0.0)), 0, 0)
    spec.choose(SchedulePlan((ScheduledRow(prompt, 0, 0, True, 256, 0, True),), (), (), ()))
    spec.observe_finished(256, 128)
    assert spec.traffic.chunk_tokens == 256 and spec.traffic.prefill_per_token() == 2.0
    spec.forget_profile()
    assert spec.traffic.chunk_tokens == 0 and spec.traffic.prefill_per_token() == 0.0
