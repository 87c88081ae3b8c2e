"""What the speculation policy learns of acceptance from verified windows: each request's estimate, the
instance's, and the same counts whichever form a step's learning takes."""

import numpy as np

from mtpserve.engine import spec_learning
from mtpserve.engine.spec_stats import DepthAcceptance, SlotAcceptance
from mtpserve.engine.speculation import Speculation
from spec_rows import K


def test_each_slot_learns_from_its_own_windows_and_a_new_request_starts_from_the_prior():
    table, prior = SlotAcceptance(num_slots=4, max_drafts=K, decay=0.9), np.full(K, 0.7)
    for _ in range(50):  # slot 0 accepts every draft, slot 1 none (so only its depth 1 is ever tried)
        table.observe(np.array([0, 1]), np.array([K, K]), np.array([K, 0]))
    got = table.rates(np.array([0, 1, 2]), prior)
    assert got[0].min() > 0.9
    assert got[1, 0] < 0.25 and np.allclose(got[1, 1:], prior[1:])  # ~10 windows of evidence against 4 of prior
    assert np.allclose(got[2], prior)  # a slot that saw nothing
    table.reset(np.array([0]))
    assert np.allclose(table.rates(np.array([0]), prior), prior)


def test_a_spell_of_shallower_windows_keeps_what_a_request_learnt_of_the_deeper_depths():
    """Windows that do not reach a depth say nothing of it: a request whose second drafts were accepted
    keeps that estimate through 40 windows of one draft (decayed by them, its estimate of depth 2 was
    the prior again), while its own depth-1 evidence keeps following its windows."""
    table, prior = SlotAcceptance(num_slots=1, max_drafts=K, decay=0.9), np.full(K, 0.5)
    for _ in range(20):
        table.observe(np.array([0]), np.array([2]), np.array([2]))
    before = table.rates(np.array([0]), prior)[0]
    for i in range(40):  # one draft a window, accepted three times in four
        table.observe(np.array([0]), np.array([1]), np.array([int(i % 4 < 3)]))
    after = table.rates(np.array([0]), prior)[0]
    assert before[1] > 0.8 and after[1] == before[1]
    assert 0.6 < after[0] < 0.85  # depth 1 followed the last windows
    assert np.allclose(after[2], prior[2])  # never tried


def test_only_depths_drafted_over_a_complete_mtp_context_teach_the_instance():
    """A request whose MTP KV has gaps beyond depth 1 (a step ran one depth) teaches the instance's prior
    its first depth only; its own estimate learns every depth."""
    spec = Speculation(K, adaptive=True, num_slots=2)
    for _ in range(100):
        spec.observe_windows(np.array([0]), np.array([K]), np.array([0]), complete=np.array([1]))
    assert spec.instance.whole.tried[0] > 0 and spec.instance.whole.tried[1:].sum() == 0
    assert spec.requests.rates(np.array([0]), spec.instance.rates())[0, 0] < 0.25
    windows = DepthAcceptance(K, decay=0.999)
    windows.observe(np.array([0, 2]), np.array([0, 2]))  # a window of no drafts counts for nothing
    assert windows.tried.tolist() == [1.0, 1.0, 0.0] and windows.accepted.tolist() == [1.0, 1.0, 0.0]
    table = SlotAcceptance(2, K, decay=0.9)
    table.observe(np.array([0, 1]), np.array([K, 0]), np.array([1, 0]))  # K drafts, the first accepted; none
    assert table.tried.tolist() == [[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]]
    assert table.accepted.tolist() == [[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]


def test_windows_over_gapped_contexts_can_only_raise_the_prior():
    """What drafts over an MTP context with gaps accept is a lower bound of what whole contexts accept: it
    lifts the instance's prior where it is more (evidence shrunk towards 0, not towards the first prior)
    and never lowers it."""
    spec, slots, rng = Speculation(K, adaptive=True, num_slots=64), np.arange(64), np.random.default_rng(3)
    assert np.allclose(spec.instance.rates(), spec.instance.whole.rates())  # nothing seen: the first prior
    gapped = lambda rate: spec.observe_windows(slots, np.ones(64, np.int64),  # noqa: E731
                                               (rng.random(64) < rate).astype(np.int64), np.zeros(64, np.int64))
    for _ in range(20):
        gapped(0.9)
    assert spec.instance.whole.tried.sum() == 0 and 0.85 < spec.instance.rates()[0] < 0.95
    assert spec.instance.rates()[0] > spec.instance.whole.rates()[0]
    for _ in range(200):
        gapped(0.1)
    assert spec.instance.rates()[0] == spec.instance.whole.rates()[0]  # the first prior, not the gapped windows' 0.1


def test_a_step_of_a_few_rows_learns_as_a_whole_step_would(monkeypatch):
    """Row by row (a step of up to FEW_ROWS rows) or as one step through the table, the same windows leave
    the same counts: each request's, and the instance's over the depths complete in each window."""
    rng = np.random.default_rng(7)
    steps = []
    for _ in range(300):
        rows = int(rng.integers(1, spec_learning.FEW_ROWS + 1))
        drafts = rng.integers(0, K + 1, rows)
        steps.append((rng.choice(6, rows, replace=False), drafts, rng.integers(0, drafts + 1),
                      rng.integers(0, K + 1, rows)))
    few, whole = Speculation(K, adaptive=True, num_slots=6), Speculation(K, adaptive=True, num_slots=6)
    for step in steps:
        few.observe_windows(*step)
    monkeypatch.setattr(spec_learning, "FEW_ROWS", 0)
    for step in steps:
        whole.observe_windows(*step)
    assert few.requests.counts.sum() > 0 and few.instance.whole.counts.sum() > 0
    assert np.allclose(few.requests.counts, whole.requests.counts, rtol=1e-12)
    assert np.allclose(few.instance.whole.counts, whole.instance.whole.counts, rtol=1e-12)
    assert few.instance.every.counts.sum() > few.instance.whole.counts.sum()
    assert np.allclose(few.instance.every.counts, whole.instance.every.counts, rtol=1e-12)
