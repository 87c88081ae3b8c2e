"""The speculation policy on synthetic costs and acceptance curves where the right answer is known."""

import numpy as np
import pytest

from mtpserve.engine.spec_cost import PeriodTable, StepCostModel, features
from mtpserve.engine.spec_policy import StepCost, choose_depth, expected_tokens, row_drafts
from mtpserve.engine.request import EngineRequest, Request
from mtpserve.engine.scheduler import SchedulePlan, ScheduledRow
from mtpserve.engine.spec_stats import DepthAcceptance
from mtpserve.engine.speculation import Speculation
from mtpserve.ipc.sampling_params import SamplingParams

K = 3
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


def test_the_cost_model_learns_a_linear_device():
    truth = StepCost(base=2e-3, per_token=0.3e-3, per_verify_row=0.04e-3, per_depth=0.3e-3,
                     per_mtp_token=0.1e-3)
    model = StepCostModel()
    gen = np.random.default_rng(0)
    for _ in range(400):
        tokens, rows, width, depths = int(gen.integers(1, 600)), int(gen.integers(1, 64)), \
            int(gen.integers(1, K + 2)), int(gen.integers(0, K + 1))
        model.observe(features(tokens, rows, width, depths), truth.seconds(tokens, rows, width, depths))
    assert np.allclose(model.cost(), truth, rtol=0.02, atol=1e-6)


def steady(periods_ms: list[float], rows: int, acceptance: float, current: int = 0) -> int:
    """The depth a decode step gets when each depth's period is measured as given."""
    spec = Speculation(K, adaptive=True)
    delivered = rows * expected_tokens(rates(acceptance))[0]  # what such steps emit, on average
    for depth, ms in enumerate(periods_ms):
        for _ in range(PeriodTable.MIN_SAMPLES):
            spec.periods.observe(rows, depth, ms * 1e-3, int(round(delivered[depth])))
    spec._depth = current
    plan = SchedulePlan(tuple(decode_row(i) for i in range(rows)), (), (), ())
    for row in plan.rows:  # NOTE: 100 windows' worth of evidence at the given rate per depth
        row.request.acceptance = DepthAcceptance(K, decay=0.9)
        row.request.acceptance.tried = [100.0] * K
        row.request.acceptance.accepted = [100.0 * acceptance] * K
    spec._policy(plan, caps(rows))
    return spec._depth


def decode_row(i: int) -> ScheduledRow:
    request = Request(EngineRequest(i, (1, 2, 3), SamplingParams(temperature=0.0)), i, 0)
    return ScheduledRow(request, 0, i, False, K + 1, 0, True)


def test_a_steady_decode_load_takes_the_depth_its_measured_periods_favour():
    """The CPU figures of the bundled model at 1 and 4 rows (ms per step at depth 0..3), acceptance 0.85:
    drafting pays at 1 row, not at 4."""
    assert steady([1.52, 2.38, 3.10, 3.90], rows=1, acceptance=0.85) >= 2
    assert steady([2.29, 4.70, 6.40, 8.40], rows=4, acceptance=0.85) == 0


def test_the_shallowest_depth_near_the_best_is_taken_and_deeper_must_be_clearly_better():
    gain = expected_tokens(rates(0.85))
    flat = {0: 4.0, 1: 4.0 * gain[0, 1] * 0.99, 2: 20.0, 3: 30.0}  # depth 1 about 1% better than depth 0
    choose = lambda current: choose_depth(gain, caps(1), np.zeros(1, np.int64), flat.__getitem__,  # noqa: E731
                                          current, margin=0.03)
    assert choose(0) == 0 and choose(1) == 0 and choose(3) == 0
    clear = {**flat, 1: 4.0 * gain[0, 1] * 0.9}  # depth 1 about 10% better than depth 0
    choose = lambda current: choose_depth(gain, caps(1), np.zeros(1, np.int64), clear.__getitem__,  # noqa: E731
                                          current, margin=0.03)
    assert choose(0) == 1 and choose(1) == 1 and choose(3) == 1
    # depth 2 within the margin of the best (3) but only 2% better than depth 1, the current: kept
    band = {0: 4.0, 1: 4.0 * gain[0, 1] * 0.9, 2: 4.0 * gain[0, 2] * 0.9 / 1.02, 3: 4.0 * gain[0, 3] * 0.9 / 1.04}
    rates_at = {d: float(gain[0, d]) / band[d] for d in band}
    assert rates_at[2] < rates_at[1] * 1.03 and rates_at[2] * 1.03 >= max(rates_at.values())
    assert choose_depth(gain, caps(1), np.zeros(1, np.int64), band.__getitem__, 1, margin=0.03) == 1


def test_a_depth_not_measured_at_these_rows_is_scaled_from_the_nearest_batch():
    table = PeriodTable()
    for _ in range(PeriodTable.MIN_SAMPLES):
        table.observe(4, 0, 2e-3, 4)
        table.observe(4, 2, 6e-3, 10)  # at 4 rows depth 2 takes 3x depth 0
        table.observe(16, 0, 6e-3, 16)  # at 16 rows only depth 0 was seen
    assert table.seconds(16, 2) == pytest.approx(18e-3)
    assert table.seconds(16, 1) is None  # measured nowhere
    assert table.seconds(4, 2) == pytest.approx(6e-3)
    assert table.tokens_per_second(4, 2) == pytest.approx(10 / 6e-3)
    # delivered rates scale the same way: 16 rows at depth 0 times depth 2's gain over depth 0 at 4 rows
    assert table.tokens_per_second(16, 2) == pytest.approx((16 / 6e-3) * (10 / 6e-3) / (4 / 2e-3))
    assert table.tokens_per_second(16, 1) is None


def test_measured_rates_win_over_the_estimate():
    """Acceptance estimates say depth 2 (E = 2.71 tokens per window at 0.9), but the steps delivered more
    at depth 0: the measurement decides."""
    gain = expected_tokens(rates(0.9, 0.9, 0.9, 0.9))
    period = {0: 3e-3, 1: 5e-3, 2: 6e-3, 3: 9e-3}.__getitem__
    zeros = np.zeros(4, np.int64)
    assert choose_depth(gain, caps(4), zeros, period, current=0, margin=0.0) == 2
    measured: dict[int, float | None] = {0: 1400.0, 1: 1200.0, 2: 1150.0, 3: 1000.0}
    assert choose_depth(gain, caps(4), zeros, period, current=2, margin=0.0, measured=measured) == 0


def test_a_steady_load_does_not_wind_the_cost_model_up():
    """One shape for a long time: forgetting alone would grow the covariance until it overflowed."""
    model = StepCostModel()
    x = features(64, 64, 1, 0)
    for _ in range(50_000):
        model.observe(x, 0.03)
    assert np.isfinite(model.covariance).all() and np.abs(model.covariance).max() <= 500
    assert abs(model.predict(x) - 0.03) < 1e-3
