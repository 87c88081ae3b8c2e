"""The speculation policy on synthetic costs and acceptance curves where the right answer is known."""

import numpy as np
import pytest

from mtpserve.engine.spec_cost import PeriodTable, StepCostModel, features
from mtpserve.engine.spec_policy import StepCost, choose_drafts, expected_tokens
from mtpserve.engine.speculation import Speculation

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


def test_batch_one_with_high_acceptance_drafts_the_maximum():
    assert choose_drafts(rates(0.9), caps(1), SPARE, 0).tolist() == [K]


def test_acceptance_near_zero_drafts_nothing():
    assert choose_drafts(rates(0.01), caps(1), SPARE, 0).tolist() == [0]


def test_cost_linear_in_rows_drafts_nothing_at_a_large_batch():
    assert choose_drafts(rates(*[0.7] * 64), caps(64), LINEAR, 0).tolist() == [0] * 64


def test_requests_that_differ_get_different_drafts():
    got = choose_drafts(rates(0.95, 0.95, 0.02, 0.02), caps(4), SPARE, 0)
    assert got[0] == got[1] > 0 and got[2] == got[3] == 0


def test_a_request_cap_and_floor_are_kept():
    assert choose_drafts(rates(0.95, 0.95), np.array([1, K]), SPARE, 0).tolist() == [1, K]
    floors = np.array([K, 0])
    assert choose_drafts(rates(0.01, 0.01), caps(2), SPARE, 0, floors).tolist() == [K, 0]


def test_prefill_tokens_in_the_step_make_drafting_relatively_cheaper():
    """With a long prefill chunk in the step, its cost dwarfs a few draft tokens."""
    medium = StepCost(base=1e-3, per_token=0.3e-3, per_verify_row=0.05e-3, per_depth=0.2e-3,
                      per_mtp_token=0.1e-3)
    alone = choose_drafts(rates(*[0.45] * 8), caps(8), medium, 0)
    with_prefill = choose_drafts(rates(*[0.45] * 8), caps(8), medium, 512)
    assert with_prefill.sum() > alone.sum()


@pytest.mark.parametrize("batch", [1, 4, 16, 64])
def test_the_choice_is_never_worse_than_any_uniform_k(batch):
    """Brute force over uniform k: the policy's expected tokens per second is at least the best of them."""
    gen = np.random.default_rng(batch)
    acceptance = gen.uniform(0.0, 1.0, (batch, K))
    for cost in (SPARE, LINEAR):
        chosen = choose_drafts(acceptance, caps(batch), cost, 0)
        best_uniform = max(rate(acceptance, np.full(batch, k), cost) for k in range(K + 1))
        assert rate(acceptance, chosen, cost) >= best_uniform * (1 - 1e-9)


def rate(acceptance: np.ndarray, drafts: np.ndarray, cost: StepCost) -> float:
    gain = expected_tokens(acceptance)[np.arange(len(drafts)), drafts].sum()
    width = int(drafts.max()) + 1
    return gain / cost.seconds(float((drafts + 1).sum()), len(drafts), width, int(drafts.max()))


def test_an_oscillating_batch_switches_without_hysteresis_or_failure():
    """Around the switching point the choice follows the batch both ways, every time."""
    medium = StepCost(base=4e-3, per_token=0.4e-3, per_verify_row=0.05e-3, per_depth=0.2e-3,
                      per_mtp_token=0.15e-3)
    small = [int(choose_drafts(rates(0.6), caps(1), medium, 0).max()) for _ in range(3)]
    choices = []
    for _ in range(20):
        choices.append(int(choose_drafts(rates(*[0.6] * 64), caps(64), medium, 0).max()))
        choices.append(int(choose_drafts(rates(0.6), caps(1), medium, 0).max()))
    assert small[0] > 0 and choices[1::2] == [small[0]] * 20 and choices[0::2] == [choices[0]] * 20
    assert choices[0] < small[0]


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


def steady(periods_ms: list[float], rows: int, acceptance: float, current: int | None = None) -> int:
    """The depth a decode-only step gets when each depth's period is measured as given."""
    spec = Speculation(K, adaptive=True)
    for depth, ms in enumerate(periods_ms):
        for _ in range(PeriodTable.MIN_SAMPLES):
            spec.periods.observe(rows, depth, ms * 1e-3)
    if current is not None:
        spec._depth = current
    gain = expected_tokens(rates(*[acceptance] * rows))
    return int(spec._steady_depth(gain, caps(rows), np.zeros(rows, np.int64)).max())


def test_a_steady_decode_load_takes_the_depth_its_measured_periods_favour():
    """The CPU figures of the bundled model at 1 and 4 rows (ms per step at depth 0..3), acceptance 0.85:
    drafting pays at 1 row, not at 4."""
    assert steady([1.52, 2.38, 3.10, 3.90], rows=1, acceptance=0.85) >= 2
    assert steady([2.29, 4.70, 6.40, 8.40], rows=4, acceptance=0.85) == 0


def test_a_depth_is_kept_unless_another_is_clearly_better():
    flat = [4.0, 4.0 * 1.85 / 1.0 * 0.99, 20.0, 30.0]  # depth 1 about 1% better than depth 0
    assert steady(flat, rows=1, acceptance=0.85, current=0) == 0
    assert steady(flat, rows=1, acceptance=0.85, current=1) == 1
