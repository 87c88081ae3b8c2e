"""What serving adds to a step (spec_extra.ServingExtra): kept per emitting rows and per kind of step, each
depth's own mean while it is recent, and nothing from a load's first steps (docs/speculation.md)."""

import pytest
from mtpserve.engine.spec_extra import ServingExtra
from mtpserve.engine.spec_regime import Regime

WARMUP = ServingExtra.WARMUP_STEPS


@pytest.fixture(autouse=True)
def steady(monkeypatch):
    """These tests price a steady load: what serving adds is learnt from its first step."""
    monkeypatch.setattr(ServingExtra, "WARMUP_STEPS", 0)


def test_a_depth_not_run_for_a_while_is_priced_again_as_the_depth_in_use_and_then_afresh():
    """A depth's own price is recent or not used: serving's share of the cores moves, and a price learnt in
    a busy spell would otherwise keep the policy off that depth for good."""
    extra = ServingExtra()
    for _ in range(ServingExtra.STALE_STEPS // ServingExtra.YOUNG_STEPS):
        extra.observe(4, 5e-3, 2e-3, depth=2)  # a busy spell at depth 2, long enough to stay recent as long as any
    assert extra.seconds(4, depth=2) == pytest.approx(3e-3)
    for _ in range(ServingExtra.STALE_STEPS):
        extra.observe(4, 1.5e-3, 1e-3, depth=1)
    assert extra.seconds(4, depth=2) == pytest.approx(3e-3)  # still recent
    extra.observe(4, 1.5e-3, 1e-3, depth=1)
    assert extra.seconds(4, depth=2) == pytest.approx(0.5e-3)  # not: every depth's mean, the depth in use's
    for i in range(ServingExtra.MIN_SAMPLES):
        assert extra.seconds(4, depth=2) < 1e-3  # run again: not priced by the old spell meanwhile
        extra.observe(4, 2.8e-3, 2e-3, depth=2)
    assert extra.seconds(4, depth=2) == pytest.approx(0.8e-3)  # its own again, from its new steps alone


def test_a_depth_priced_by_a_few_steps_is_priced_as_the_depth_in_use_sooner():
    """The first steps that serve are slow: a depth run only then must not keep their price for STALE_STEPS
    (the policy stayed at the other depth that long where this one was faster)."""
    extra = ServingExtra()
    young = 2 * ServingExtra.MIN_SAMPLES
    for _ in range(young):
        extra.observe(4, 3.5e-3, 2e-3, depth=1)  # the first steps: 1.5 ms more than the profile
    for _ in range(young * ServingExtra.YOUNG_STEPS):
        extra.observe(4, 3e-3, 2.5e-3, depth=2)  # then depth 2's steps, 0.5 ms more
    assert extra.seconds(4, depth=1) == pytest.approx(1.5e-3)  # still its own
    extra.observe(4, 3e-3, 2.5e-3, depth=2)
    # NOTE: every depth's mean, the depth in use's by now: a mean of a few steps is recent for fewer
    assert extra.seconds(4, depth=1) == pytest.approx(0.5e-3, rel=0.01)
    for _ in range(young):
        extra.observe(4, 2.4e-3, 2e-3, depth=1)  # run again: afresh, without the first steps
    assert extra.seconds(4, depth=1) == pytest.approx(0.4e-3)


def test_the_first_steps_at_these_rows_teach_nothing(monkeypatch):
    """A load's first steps are slow (at 4 streams on code, 0.8-2.4 ms more than the profile for ~20-25
    steps, 0.3-0.5 ms later): learnt, they priced the depth that ran them out of use."""
    monkeypatch.setattr(ServingExtra, "WARMUP_STEPS", WARMUP)
    extra = ServingExtra()
    for _ in range(WARMUP):
        extra.observe(4, 4e-3, 2e-3, depth=1)
    assert extra.seconds(4, depth=1) == 0.0  # nothing learnt yet
    for _ in range(ServingExtra.MIN_SAMPLES):
        extra.observe(4, 2.4e-3, 2e-3, depth=1)
    assert extra.seconds(4, depth=1) == pytest.approx(0.4e-3)
    for _ in range(ServingExtra.MIN_SAMPLES):
        extra.observe(8, 5e-3, 4e-3, depth=1)  # the first steps at other rows: nothing learnt there either
    assert extra.seconds(8, depth=1) == pytest.approx(0.4e-3)  # the nearest rows' (every depth's) mean


def test_the_first_steps_at_these_rows_count_for_the_spell_they_run(monkeypatch):
    """A cell's first steps teach no price, but the host runs their depth's spell: a depth that ran them and a
    few more settles, and is priced by its own spell once another depth holds the cell. At 64 streams on code,
    depth 0's first spell of 56 steps settled nothing after the warm-up, and depth 1's spell lent it 7.6 ms where
    its own steps added 9.6: the policy went back to depth 0 and stayed there (docs/speculation.md)."""
    monkeypatch.setattr(ServingExtra, "WARMUP_STEPS", WARMUP)
    extra = ServingExtra()

    def steps(count: int, depth: int, added: float) -> None:
        for _ in range(count):  # NOTE: the device thread slowed by all of it, as on this host
            extra.observe(64, 5e-3 + added, 5e-3, depth=depth, device_thread=5e-3 + added)

    steps(WARMUP, 0, 12e-3)
    steps(Regime.SETTLED_MIN_STEPS, 0, 9e-3)
    steps(Regime.STEPS + Regime.SETTLED_MIN_STEPS, 1, 10e-3)  # a seek of depth 1: the spell is depth 1's now
    tokens = {0: 64.0, 1: 117.0}.__getitem__
    assert extra.lender(64, 0) is None
    assert extra.priced(64, 0, tokens) == pytest.approx(9e-3)
    assert extra.priced(64, 1, tokens) == pytest.approx(10e-3)


def test_the_prompts_share_takes_both_kinds_of_step_from_one_source():
    """A depth with its own decode mean but no own chunk mean yet: the extra of a chunk step over a decode
    step is every depth's chunk steps less every depth's decode steps, not less this depth's own decode
    steps; once it has both of its own, its own two."""
    extra = ServingExtra()
    for i in range(4 * ServingExtra.MIN_SAMPLES):
        extra.observe(16, 3e-3, 2e-3, depth=0)  # decode steps at depth 0 add 1 ms
        if i % 2 == 0:
            extra.observe(16, 2.5e-3, 2e-3, has_prefill=True, depth=0)  # its chunk steps 0.5 ms
    for _ in range(ServingExtra.MIN_SAMPLES):
        extra.observe(16, 5e-3, 2e-3, depth=1)  # depth 1's decode steps: 3 ms (its profile priced it low)
    assert extra.seconds(16, depth=1) == pytest.approx(3e-3)
    assert extra.chunk_extra(16, 1) == pytest.approx(extra.measured(16, True) - extra.measured(16))
    for _ in range(ServingExtra.MIN_SAMPLES):
        extra.observe(16, 6e-3, 2e-3, has_prefill=True, depth=1)  # its chunk steps: 4 ms
    assert extra.chunk_extra(16, 1) == pytest.approx(1e-3)


def test_what_serving_adds_is_kept_per_emitting_rows():
    extra = ServingExtra()
    assert extra.seconds(64) == 0.0  # nothing measured yet
    for i in range(ServingExtra.MIN_SAMPLES - 1):
        device = 10e-3 if i % 2 else 40e-3  # with a prompt chunk and without
        extra.observe(64, device + 9e-3, device)
    assert extra.seconds(64) == 0.0  # not enough steps yet
    extra.observe(64, 34e-3, 25e-3)
    assert extra.seconds(64) == pytest.approx(9e-3)
    assert extra.seconds(60) == pytest.approx(9e-3)  # the same half octave of emitting rows
    for _ in range(ServingExtra.MIN_SAMPLES):
        extra.observe(4, 2e-3, 1.5e-3)
    assert extra.seconds(4) == pytest.approx(0.5e-3) and extra.seconds(8) == pytest.approx(0.5e-3)  # the nearest


def _steps(extra: ServingExtra, n: int, added: float, depth: int, rows: int = 64, device: float = 10e-3) -> None:
    for _ in range(n):
        extra.observe(rows, device + added, device, depth=depth)


def test_a_depth_left_on_a_sharp_rise_is_suspect_and_keeps_its_price_until_sought():
    """Left while its mean had risen sharply (a burst), a depth keeps the price it has, says what it added
    before the rise, and is priced afresh once sought; run again without a seek, it is no longer suspect."""
    extra = ServingExtra()
    _steps(extra, 300, 4e-3, depth=1)
    _steps(extra, 30, 8e-3, depth=1)  # a burst: ~1.8 ms on the mean, ~9% of a 20 ms step
    risen = extra.seconds(64, depth=1)
    _steps(extra, 1, 4e-3, depth=0)  # the policy left depth 1
    assert extra.suspect(64, 1) == pytest.approx(4e-3)
    assert extra.seconds(64, depth=1) == pytest.approx(risen)
    extra.seek(64, 1)
    assert extra.suspect(64, 1) is None
    _steps(extra, ServingExtra.MIN_SAMPLES, 4.2e-3, depth=1)
    assert extra.seconds(64, depth=1) == pytest.approx(4.2e-3)  # its seek's steps alone
    _steps(extra, 300, 4e-3, depth=1)
    _steps(extra, 30, 8e-3, depth=1)
    _steps(extra, 1, 4e-3, depth=0)
    _steps(extra, 1, 8e-3, depth=1)  # run again: its own steps price it, as for any depth in use
    assert extra.suspect(64, 1) is None


def test_a_depth_left_after_a_slow_climb_or_a_small_rise_is_not_suspect():
    """A mean that creeps up over its last PAST_STEPS steps (contexts growing), or rises by less than
    RISE_SHARE of its step, is what the depth takes now."""
    extra = ServingExtra()
    for i in range(400):
        extra.observe(64, 10e-3 + 4e-3 + 3e-3 * i / 400, 10e-3, depth=1)  # +3 ms over 400 steps
    _steps(extra, 1, 4e-3, depth=0)
    assert extra.suspect(64, 1) is None
    _steps(extra, 300, 4e-3, depth=1)
    _steps(extra, 30, 5e-3, depth=1)  # ~0.45 ms on the mean: ~3% of its step
    _steps(extra, 1, 4e-3, depth=0)
    assert extra.suspect(64, 1) is None
