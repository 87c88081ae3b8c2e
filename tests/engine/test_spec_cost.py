"""The speculation policy's cost model (engine/spec_cost.py): curves over what a step computes, the start-up
profile's settled cells, and what attention costs per key and per pair."""

import pytest
from mtpserve.engine.spec_cost import StepCosts, StepLoad
from mtpserve.engine.spec_curve import Curve
from mtpserve.engine.step_plan import StepTiming
from spec_rows import K


def test_a_curve_interpolates_between_cells_and_extends_by_its_unit_cost():
    """A CPU-like device: flat while the weights' reading dominates, then linear in tokens."""
    device = lambda n: max(2e-3, 0.1e-3 * n)  # noqa: E731
    curve = Curve(prior=lambda n: 1.0)
    assert curve(8) == 1.0  # nothing measured: the prior
    for n in (1, 4, 16, 64, 128):
        for _ in range(Curve.MIN_SAMPLES):
            curve.observe(n, device(n))
    assert curve(1) == pytest.approx(2e-3) and curve(128) == pytest.approx(12.8e-3)
    assert curve(96) == pytest.approx((6.4e-3 + 12.8e-3) / 2)  # halfway between the cells of 64 and 128
    assert curve(0.5) == pytest.approx(2e-3)  # below the lowest cell: its value
    assert curve(512) == pytest.approx(4 * 12.8e-3)  # above the highest: its cost per token


def test_a_curve_follows_a_device_that_slows_down():
    curve = Curve(prior=lambda n: 0.0)
    for _ in range(50):
        curve.observe(32, 5e-3)
    for _ in range(100):
        curve.observe(32, 10e-3)
    assert curve(32) == pytest.approx(10e-3, rel=0.01)


def test_a_settled_curve_keeps_the_quiet_device_time_through_bursts_and_learns_no_more():
    """A profile where one pass in three ran beside a burst of other work (twice as slow): the settled cell
    is the quiet time, where the mean would be a third higher."""
    curve = Curve(prior=lambda n: 0.0)
    for i in range(36):
        curve.observe(16, 4e-3 if i // 12 == 1 else 2e-3)
    assert curve(16) > 2.5e-3  # the running mean saw the burst
    curve.settle()
    assert curve(16) == pytest.approx(2e-3)
    for _ in range(50):
        curve.observe(16, 9e-3)
    assert curve(16) == pytest.approx(2e-3)


def test_the_profile_learns_what_attention_costs_per_key_and_per_pair_and_charges_it_to_each_depth():
    """A device where each key read costs the target pass 0.3 us and each (query, key) pair 0.04 us, and
    each depth 0.08 us a key and 0.01 a pair, profiled as the start-up profile does (every depth at 1, 4 and
    16 rows of 32 and 384 positions, and 64 rows of 32): both slopes of each are recovered, and at 64 rows
    of 360 positions, where the profile never ran, depths 0 and 1 are priced within 5% of what they cost.
    Priced per pair alone, depth 0 came out 24% cheap and depth 1 1% dear."""
    def device(rows: int, depth: int, ctx: int) -> tuple[StepLoad, float, float]:
        width = depth + 1
        keys, pairs = rows * (ctx + width), rows * width * (ctx + width)
        target = 1e-3 + 0.1e-3 * rows * width + 0.3e-6 * keys + 0.04e-6 * pairs
        per_depth = 0.3e-3 + 0.02e-3 * rows * width + 0.08e-6 * keys + 0.01e-6 * pairs
        return StepLoad(rows * width, rows, depth, False, rows, pairs, keys), target, depth * per_depth

    costs = StepCosts()
    for rows, ctx in [(rows, ctx) for rows in (1, 4, 16) for ctx in (32, 384)] + [(64, 32)]:
        for depth in range(K + 1):
            for noise in (1.0, 1.1, 1.3):  # NOTE: other work on the host only ever adds time
                load, target, drafts = device(rows, depth, ctx)
                costs.observe(load, 0.0, StepTiming(target * noise, drafts * noise))
    costs.freeze()
    assert costs.target_attention.per_key == pytest.approx(0.3e-6, rel=0.15)
    assert costs.target_attention.per_pair == pytest.approx(0.04e-6, rel=0.15)
    assert costs.depth_attention.per_key == pytest.approx(0.08e-6, rel=0.15)
    assert costs.depth_attention.per_pair == pytest.approx(0.01e-6, rel=0.15)
    for depth in (0, 1):
        load, target, drafts = device(64, depth, 360)
        assert costs.device(load) == pytest.approx(target + drafts, rel=0.05)


def test_the_step_costs_split_the_device_time_into_target_and_depths():
    costs = StepCosts()
    for _ in range(Curve.MIN_SAMPLES):
        # 4 rows at depth 2: 12 tokens; the device spent 6 ms on the target, 2 x 1.5 ms drafting
        costs.observe(StepLoad(12, 4, 2, False), 10e-3, StepTiming(6e-3, 3e-3))
    assert costs.decode(12) == pytest.approx(6e-3) and costs.depth(12) == pytest.approx(1.5e-3)
    assert costs.device(StepLoad(12, 4, 1, False)) == pytest.approx(7.5e-3)
    # a step with a prefill chunk is not a decode step of as many tokens: its own curve (the prior here)
    assert costs.device(StepLoad(12, 4, 2, True)) != pytest.approx(9e-3)
    costs.freeze()
    costs.observe(StepLoad(12, 4, 2, False), 30e-3, StepTiming(20e-3, 9e-3))
    assert costs.decode(12) == pytest.approx(6e-3)  # frozen: serving does not move them
