"""What serving adds to a step (spec_extra.py): a stalled step counts for little, a lasting change in full."""

import pytest
from mtpserve.engine.spec_extra import ServingExtra


def test_a_stalled_step_moves_what_serving_adds_by_little_and_a_lasting_change_fully():
    extra = ServingExtra()
    for _ in range(100):
        extra.observe(4, 2.5e-3, 2e-3)  # serving adds 0.5 ms to a 2 ms step
    extra.observe(4, 12e-3, 2e-3)  # a 10 ms stall of the host
    cap = ServingExtra.SPIKE_CAP * 2e-3
    assert extra.seconds(4) == pytest.approx(0.5e-3 + ServingExtra.WEIGHT * cap), "counted as 1 ms above the mean"
    for _ in range(300):
        extra.observe(4, 4e-3, 2e-3)  # serving now adds 2 ms to every step
    assert extra.seconds(4) == pytest.approx(2e-3, rel=0.01)


def test_a_step_below_the_mean_counts_in_full():
    extra = ServingExtra()
    for _ in range(100):
        extra.observe(4, 2.5e-3, 2e-3)
    extra.observe(4, 1.5e-3, 2e-3)  # shorter than the profile's curves: -0.5 ms
    assert extra.seconds(4) == pytest.approx(0.5e-3 - ServingExtra.WEIGHT * 1e-3)


def test_a_depth_not_in_use_moves_with_the_depth_in_use():
    """Serving added 1.1 ms to steps at depth 1 and at depth 2 while the host was busy; then it calmed, and the
    policy's depth-2 steps took 0.5 ms. Depth 1, not run meanwhile, is priced at 0.5 too: kept at 1.1 ms, the
    depth in use looked the cheaper one by the contention of the moment it was left."""
    extra = ServingExtra()
    for depth in (1, 2):
        for _ in range(100):
            extra.observe(4, 3.1e-3, 2e-3, depth=depth)
    for _ in range(200):
        extra.observe(4, 3.0e-3, 2.5e-3, depth=2)
    assert extra.seconds(4, depth=2) == pytest.approx(0.5e-3, abs=0.02e-3)
    assert extra.seconds(4, depth=1) == pytest.approx(0.5e-3, abs=0.03e-3)


def test_what_one_depth_adds_more_than_another_is_kept_as_both_move():
    """At 64 streams decode steps at depth 0 took 9-10 ms more than the curves and at depth 1 about 4 ms more
    (the profile's error differs by depth): the 5 ms between them stay while the depth in use moves."""
    extra = ServingExtra()
    for _ in range(100):
        extra.observe(64, 20e-3, 11e-3, depth=0)  # 9 ms
    for _ in range(100):
        extra.observe(64, 24e-3, 20e-3, depth=1)  # 4 ms
    for _ in range(200):
        extra.observe(64, 25e-3, 20e-3, depth=1)  # 5 ms: the host is busier
    assert extra.seconds(64, depth=1) == pytest.approx(5e-3, abs=0.1e-3)
    assert extra.seconds(64, depth=0) - extra.seconds(64, depth=1) == pytest.approx(5e-3, abs=0.1e-3)


def test_what_a_depth_adds_more_is_learnt_from_the_first_steps_of_its_spells():
    """A depth run again learns from its spell's first MIN_SAMPLES steps what it adds more than the others (a
    share of it, as a running mean learns), and from then on its mean moves them all."""
    extra = ServingExtra()
    for _ in range(100):
        extra.observe(4, 3.0e-3, 2e-3, depth=1)  # 1 ms at both depths
    for _ in range(50):
        extra.observe(4, 3.0e-3, 2e-3, depth=2)
    for _ in range(ServingExtra.MIN_SAMPLES):
        extra.observe(4, 2.3e-3, 2e-3, depth=1)  # 0.3 ms at depth 1 now
    learnt = 0.7e-3 * (1 - (1 - ServingExtra.WEIGHT) ** ServingExtra.MIN_SAMPLES)
    assert extra.seconds(4, depth=1) == pytest.approx(1e-3 - learnt)
    assert extra.seconds(4, depth=2) == pytest.approx(1e-3), "not moved by a spell's first steps"
    for _ in range(300):
        extra.observe(4, 2.3e-3, 2e-3, depth=1)
    assert extra.seconds(4, depth=1) == pytest.approx(0.3e-3, abs=0.01e-3)
    assert extra.seconds(4, depth=2) - extra.seconds(4, depth=1) == pytest.approx(learnt, abs=0.01e-3)
