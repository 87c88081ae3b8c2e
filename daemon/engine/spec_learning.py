"""What the speculation policy learns of acceptance: each running request's estimate per depth (by slot)
and the instance's, the prior of every new request; from each step's verified windows, and from each
decision (what it gives a request no drafts for, the request forgets a little).
"""

from __future__ import annotations

import numpy as np

from mtpserve.engine.spec_stats import InstanceAcceptance, SlotAcceptance, below, window_table

# NOTE: while nothing drafts, nothing teaches the instance's acceptance. One new request in a few
# (spec_hope.py) starts from at least the first prior at the first depth the instance doubts (when it
# drafts alone, its windows teach the instance again; one in 8, hoping at every depth, had 2-5% of rows
# drafting at one stream where none accept), and the instance's evidence fades back towards the first
# prior (half-life ~7,000 steps that draft nothing: under a load too heavy for one hopeful row to make a
# step draft). A fade of ~700 steps had every new request at one stream try drafting: 13-23% of rows
# drafted where none accept (0.86 of k=0).
FADE = 0.9999
# NOTE: a request that drafts nothing learns nothing, so an estimate that a few unlucky windows put low
# would hold it at depth 0 all its life: at one row on code, where k=0 is 0.8 of k=2, a request whose
# estimate read 0.8, 0.6, 0.8 (the instance's 0.87, 0.89, 0.86) stayed at depth 0. Each decision that
# gives it no drafts weakens its own evidence by REQUEST_FADE (half of it in two decisions), back towards
# the instance's estimate. A hopeful request keeps its evidence: its hope is for one window.
REQUEST_FADE = 0.7
# NOTE: likewise a request that drafts fewer than a depth never tries it again, so a few rejections there
# cut it for the rest of its life: in one process at one stream on 1,024-token outputs, 13% of rows were
# cut to one draft (1.97 tokens a step, 2.12 for k=2). At each decision, the depths beyond a row's drafts
# where its estimate is below the instance's lose what the windows since the last decision would have
# aged had they tried them (`Acceptances.fade_doubted`), so such a request tries them again within a few
# holds. Its evidence above the instance's is kept: faded back to the instance's, a request's good depth 2
# was priced low after a spell at depth 1 (SlotAcceptance.add says what that cost).

# NOTE: a step of at most this many rows learns its windows row by row (`_observe_few`), each in place
# from its table entry: at one row the whole-step form's dozen numpy calls on [1, 2, K] arrays took ~23 us
# a step, each costing its call and not its data, and row by row ~7 us (at four rows 24 and 18 us; at
# eight the whole-step form is faster). Served at one stream, with the loop's other work between steps,
# the whole-step form was ~75 us a step, 1.7% of a k=2 step.
FEW_ROWS = 4


class Acceptances:
    """The policy's acceptance estimates: `requests`, each running request's per depth by its slot; `instance`,
    the instance's, which every new request starts from."""

    def __init__(self, max_drafts: int, num_slots: int) -> None:
        self.max_drafts = max_drafts
        self.instance = InstanceAcceptance(max_drafts, decay=0.999)  # the prior of every request
        self.requests = SlotAcceptance(num_slots, max_drafts, decay=0.9)  # each running request's

    def forget(self) -> None:
        """Drop everything learnt (after the start-up profile, whose prompts are not clients')."""
        self.instance = InstanceAcceptance(self.max_drafts, decay=self.instance.decay)
        self.requests.reset(np.arange(self.requests.counts.shape[0]))

    def drafted_nothing(self) -> None:
        """A step that drafted nothing: the instance's evidence fades towards the first prior (FADE)."""
        self.instance.fade(FADE)

    def observe_windows(self, slots: np.ndarray, num_drafts: np.ndarray, num_accepted: np.ndarray,
                        complete: np.ndarray) -> None:
        """A step's verified windows [R]: their slots, drafts, drafts accepted, and the MTP depths their
        requests ran in every step (`Request.mtp_depth`)."""
        if slots.size <= FEW_ROWS:
            self._observe_few(slots.tolist(), num_drafts.tolist(), num_accepted.tolist(), complete.tolist())
            return
        # NOTE: a window of no drafts adds nothing to either estimate (its counts are 0), so none is filtered out
        windows = window_table(self.max_drafts)[num_drafts, num_accepted]  # [R, 2, K]
        self.requests.add(slots, windows)
        # NOTE: the instance's estimate is every new request's prior: only drafts made over a complete
        # MTP context teach it, or a busy spell (little drafting, gaps) would lower it for the quiet
        # one after it; the others can only raise it (InstanceAcceptance)
        whole = below(self.max_drafts)[np.minimum(complete, self.max_drafts)]  # [R, K]
        drafted = num_drafts > 0
        self.instance.add(windows, whole, int((drafted & (complete > 0)).sum()), int(drafted.sum()))

    def _observe_few(self, slots: list[int], num_drafts: list[int], num_accepted: list[int],
                     complete: list[int]) -> None:
        """`observe_windows` row by row, for a step of a few rows: the same counts."""
        # NOTE: what the instance learns of a window is its complete depths: the table's window of at most
        # as many drafts and accepted drafts as those depths
        whole, every = [], []
        for slot, drafts, accepted, depths in zip(slots, num_drafts, num_accepted, complete):
            if not drafts:
                continue
            self.requests.add_window(slot, drafts, accepted)
            every.append((drafts, accepted))
            if depths > 0:
                whole.append((min(drafts, depths), min(accepted, depths)))
        if every:
            self.instance.add_each(whole, every)

    def fade_idle(self, slots: np.ndarray, drafts: np.ndarray) -> None:
        """The requests a decision gave no drafts (but hopeful ones) drift back towards the instance
        (REQUEST_FADE)."""
        idle = slots[(drafts == 0) & ~self.requests.hopeful[slots]]
        if idle.size:
            self.requests.fade(idle, REQUEST_FADE)

    def fade_doubted(self, slots: np.ndarray, drafts: np.ndarray, rates: np.ndarray, prior: np.ndarray,
                     steps: int) -> None:
        """The depths beyond each row's drafts [R] where its request's estimate (`rates` [R, K]) is below the
        instance's (`prior`) drift back towards it by the request's decay for each of the `steps` since the
        last decision (REQUEST_FADE's second note).

        NOTE: by steps, not decisions: at one row a decision holds for up to MAX_HOLD_STEPS, and a 128-token
        request sees two or three. A request that came after the last decision is faded by steps it did not
        run; its own evidence is that young, so it loses it a little faster."""
        doubted = (np.arange(self.max_drafts) >= drafts[:, None]) & (rates < prior)
        if steps and doubted.any():
            self.requests.fade_depths(slots, doubted, self.requests.decay ** steps)
