"""The spell a cell of decode steps is in (spec_regime.Regime): the depth that held it, changed only by a depth
that runs more than half of the last steps, so a probe never reads as the spell it interrupts."""

from mtpserve.engine.spec_regime import Regime

HALF = Regime.STEPS // 2


def ran(regime: Regime, depth: int, steps: int) -> None:
    for _ in range(steps):
        regime.ran(depth)


def test_no_spell_until_half_a_window_of_steps():
    regime = Regime()
    ran(regime, 1, HALF - 1)
    assert regime.depth is None
    regime.ran(1)
    assert regime.depth == 1


def test_a_probe_as_long_as_half_the_window_leaves_the_spell_where_it_was():
    """The cell ran depth 1 first, then settled at depth 0; a probe of depth 1 for half the window ties the
    counts at its last step, and the spell is still depth 0 (a rule of "the depth most steps ran" gave the tie
    to depth 1, the first the cell ran)."""
    regime = Regime()
    ran(regime, 1, HALF)
    ran(regime, 0, 2 * Regime.STEPS)
    assert regime.depth == 0
    ran(regime, 1, HALF)
    assert regime.depth == 0
    regime.ran(1)  # more than half of the window: the spell has changed
    assert regime.depth == 1


def test_a_depth_that_never_holds_a_majority_does_not_take_the_spell():
    regime = Regime()
    ran(regime, 0, Regime.STEPS)
    for _ in range(Regime.STEPS):  # three depths in turn: none runs more than half of the window
        for depth in (0, 1, 2):
            regime.ran(depth)
    assert regime.depth == 0


def served(regime: Regime, depth: int, steps: int, extra: float) -> None:
    """`steps` decode steps at `depth`, each adding `extra` to the curves."""
    for _ in range(steps):
        regime.observe_share(extra, extra)
        regime.ran(depth, extra)


def test_a_depth_s_settled_mean_takes_only_steps_after_a_window_of_it():
    """The host settles to a spell over its steps: a depth's settled mean takes what serving added once the
    cell's last STEPS steps all ran it, not the steps of the switch to it, and lasts SETTLED_STALE_STEPS."""
    regime = Regime()
    served(regime, 0, Regime.STEPS, 5.0)  # the switch: the window is not yet all depth 0
    served(regime, 0, Regime.SETTLED_MIN_STEPS - 1, 1.0)
    assert regime.settled(0) is None  # too few settled steps
    served(regime, 0, 1, 1.0)
    assert regime.settled(0) == 1.0
    served(regime, 1, Regime.STEPS, 9.0)  # depth 1's switch, not settled yet
    assert regime.settled(1) is None and regime.settled(0) == 1.0
    served(regime, 1, Regime.SETTLED_MIN_STEPS, 3.0)
    assert regime.settled(1) == 3.0
    served(regime, 1, Regime.SETTLED_STALE_STEPS - Regime.STEPS - Regime.SETTLED_MIN_STEPS, 3.0)
    assert regime.settled(0) == 1.0
    served(regime, 1, 1, 3.0)
    assert regime.settled(0) is None  # stale: the host may have moved since
