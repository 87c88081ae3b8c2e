"""Speculation counters: drafts proposed and accepted, per draft position (host side, numpy)."""

from __future__ import annotations

import functools

import numpy as np


class AcceptanceStats:
    """Cumulative counters in the vLLM convention: a window of k drafts counts one draft step,
    k draft tokens, and `num_accepted` accepted tokens, the first `num_accepted` positions each +1.
    Mean acceptance length = 1 + accepted / draft steps (the bonus token included)."""

    def __init__(self, num_speculative_tokens: int) -> None:
        self.num_draft_steps = 0
        self.num_draft_tokens = 0
        self.accepted_per_pos = np.zeros(num_speculative_tokens, dtype=np.int64)  # [k]
        self.drafted_per_pos = np.zeros(num_speculative_tokens, dtype=np.int64)  # [k]

    def observe(self, num_accepted: np.ndarray, num_drafts: np.ndarray) -> None:
        """Per verified window of this step [R]: drafts accepted and drafts it verified (windows that
        drafted nothing count for nothing)."""
        k = self.accepted_per_pos.shape[0]
        drafted = num_drafts > 0
        if k == 0 or not drafted.any():
            return
        num_accepted, num_drafts = num_accepted[drafted], num_drafts[drafted]
        pos = np.arange(k)
        self.num_draft_steps += int(num_accepted.size)
        self.num_draft_tokens += int(num_drafts.sum())
        self.drafted_per_pos += (num_drafts[:, None] > pos[None, :]).sum(axis=0)
        self.accepted_per_pos += (num_accepted[:, None] > pos[None, :]).sum(axis=0)

    @property
    def num_accepted_tokens(self) -> int:
        return int(self.accepted_per_pos.sum())

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / max(self.num_draft_steps, 1)

    def per_position_rate(self) -> list[float]:
        return (self.accepted_per_pos / np.maximum(self.drafted_per_pos, 1)).tolist()


@functools.cache
def window_table(max_drafts: int) -> np.ndarray:
    """[K+1 drafts, K+1 accepted, 2, K]: the depths a window of n drafts with a accepted tried (row 0) and
    accepted (row 1), as counts. Depth i was tried if the i drafts before it were accepted (i < n, i <= a)
    and accepted if a > i.

    NOTE: looked up, not compared: at one row the policy's per-step learning was ~40 us of numpy calls on
    [1, K] arrays, each costing its call and not its data, and the step's thread waits for the GIL."""
    n, depth = np.arange(max_drafts + 1), np.arange(max_drafts)
    drafted = depth[None, None, :] < n[:, None, None]
    tried = drafted & (depth[None, None, :] <= n[None, :, None])
    accepted = drafted & (depth[None, None, :] < n[None, :, None])
    return _frozen(np.stack([tried, accepted], axis=2).astype(np.float64))


@functools.cache
def below(max_drafts: int) -> np.ndarray:
    """[K+1, K]: row d marks the depths below d, as counts (a request's complete MTP depths)."""
    return _frozen((np.arange(max_drafts)[None, :] < np.arange(max_drafts + 1)[:, None]).astype(np.float64))


def _frozen(table: np.ndarray) -> np.ndarray:
    table.flags.writeable = False  # NOTE: cached, so shared by every caller
    return table


class DepthAcceptance:
    """A running estimate of the chance that the draft at each depth is accepted, given that the drafts
    before it were: decayed counts of tries and acceptances per depth, shrunk towards a prior. The
    instance's, over every request's windows: the prior of a new request."""

    PRIOR_WEIGHT = 4.0  # windows' worth of evidence the prior counts for
    FIRST_PRIOR = 0.7  # before anything was seen: what trained MTP heads accept at depth 1, roughly

    def __init__(self, max_drafts: int, decay: float) -> None:
        self.counts = np.zeros((2, max_drafts))  # tried, accepted
        self.tried, self.accepted = self.counts[0], self.counts[1]  # NOTE: views, updated in place
        self.decay = decay  # per window

    def observe(self, num_drafts: np.ndarray, num_accepted: np.ndarray) -> None:
        """One step's windows [R] (windows of no drafts count for nothing)."""
        windows = window_table(self.tried.shape[0])[num_drafts, num_accepted]
        self.add(windows, int((num_drafts > 0).sum()))

    def add(self, windows: np.ndarray, num_windows: int) -> None:
        """A step's windows as `window_table` counts them [R, 2, K], `num_windows` of them (each decays what
        came before)."""
        self.counts *= self.decay ** num_windows
        self.counts += windows.sum(axis=0)

    def add_each(self, windows: list[tuple[int, int]]) -> None:
        """A step's windows as `add` counts them, each as its (drafts, accepted) (a step of a few rows)."""
        self.counts *= self.decay ** len(windows)
        table = window_table(self.tried.shape[0])
        for drafts, accepted in windows:
            self.counts += table[drafts, accepted]

    def fade(self, factor: float) -> None:
        """Weaken the evidence without adding any (the estimate drifts back towards the prior)."""
        self.counts *= factor

    def rates(self) -> np.ndarray:
        """[K] conditional acceptance per depth. Each depth's evidence is shrunk towards the estimate of
        the depth before it (the first prior at depth 1, and never above it).

        NOTE: a draft deeper than one rarely accepted is rarely tried, so its estimate is mostly prior;
        a prior of the first prior at every depth had a hopeful request on random words (depth 1 at
        ~0.05) expect 0.7 at depth 2 and draft two deep: 3% of rows at one stream."""
        rates = np.empty(self.tried.shape[0])
        base = self.FIRST_PRIOR
        for depth in range(rates.shape[0]):
            rates[depth] = (self.accepted[depth] + self.PRIOR_WEIGHT * base) / (self.tried[depth] + self.PRIOR_WEIGHT)
            base = min(base, float(rates[depth]))
        return rates

    def lower_bounds(self) -> np.ndarray:
        """[K] per depth, the evidence shrunk towards 0 by the prior's weight: a rate only evidence raises."""
        return self.accepted / (self.tried + self.PRIOR_WEIGHT)


class InstanceAcceptance:
    """The instance's estimate per depth, every new request's prior: what drafts over a complete MTP context
    accept (`whole`), raised to what every draft accepts where that is more (`every`).

    NOTE: windows over a context with gaps (a prompt prefilled at a shallower depth) accept no better than
    over a whole one, so theirs is a lower bound: its evidence is shrunk towards 0, not the first prior, and
    it only raises the estimate. Whole windows alone starved it under a load mostly at depth 0: at 64
    streams on code every prompt was prefilled at depth 0, no window was whole, and the estimate stayed
    ~0.77 at depth 1 (mostly the first prior) while a seek's windows over those gapped contexts accepted
    0.80-0.86 within four steps and whole ones 0.88. Priced ~5% low, depth 1 lost to depth 0 within the
    margin and stayed unused for 1,350 steps (34 s) where its decode steps emitted 19% more a second."""

    def __init__(self, max_drafts: int, decay: float) -> None:
        self.whole = DepthAcceptance(max_drafts, decay)
        self.every = DepthAcceptance(max_drafts, decay)
        self.decay = decay
        # NOTE: fades not applied yet: one per step that drafts nothing (most steps at 16-64 streams), and the
        # estimates are read once a decision
        self._faded = 1.0

    def add(self, windows: np.ndarray, whole: np.ndarray, num_whole: int, num_windows: int) -> None:
        """A step's windows as `window_table` counts them [R, 2, K], and each one's complete depths as `below`
        marks them [R, K]; `num_whole` windows have a complete depth, `num_windows` have drafts."""
        self._fade_now()
        self.whole.add(windows * whole[:, None, :], num_whole)
        self.every.add(windows, num_windows)

    def add_each(self, whole: list[tuple[int, int]], every: list[tuple[int, int]]) -> None:
        """`add` for a step of a few rows: each window as (drafts, accepted), and its complete depths' part."""
        self._fade_now()
        if whole:
            self.whole.add_each(whole)
        self.every.add_each(every)

    def fade(self, factor: float) -> None:
        """Weaken the evidence without adding any (applied when it is next read or added to)."""
        self._faded *= factor

    def rates(self) -> np.ndarray:
        """[K] conditional acceptance per depth."""
        self._fade_now()
        return np.maximum(self.whole.rates(), self.every.lower_bounds())

    def _fade_now(self) -> None:
        if self._faded != 1.0:
            self.whole.fade(self._faded)
            self.every.fade(self._faded)
            self._faded = 1.0


class SlotAcceptance:
    """Each running request's estimate, as DepthAcceptance's, in one table by device slot: a step reads
    and updates all its rows in one numpy operation (per-request objects cost ~5 us a row a step, the
    policy's largest part at 64 rows). A request taking a slot starts from its prior alone; a hopeful
    one from at least the first prior at depth 1, which counts for a single window."""

    HOPE_WEIGHT = 1.0

    def __init__(self, num_slots: int, max_drafts: int, decay: float) -> None:
        self.counts = np.zeros((num_slots, 2, max_drafts))  # [S, tried/accepted, K]
        self.tried, self.accepted = self.counts[:, 0], self.counts[:, 1]  # NOTE: views, updated in place
        self.hopeful = np.zeros(num_slots, bool)  # [S] the request's prior is at least the first prior
        self.decay = decay  # per window of the slot's request
        # NOTE: [K+1, K+1, 1, K]: per window, the decay where it tried, as `add` computes it
        self._decays = _frozen(1.0 - (1.0 - decay) * window_table(max_drafts)[:, :, :1])

    def reset(self, slots: np.ndarray, hopeful: np.ndarray | bool = False) -> None:
        self.counts[slots] = 0.0
        self.hopeful[slots] = hopeful

    def observe(self, slots: np.ndarray, num_drafts: np.ndarray, num_accepted: np.ndarray) -> None:
        """One step's windows [R] of distinct slots."""
        self.add(slots, window_table(self.tried.shape[1])[num_drafts, num_accepted])

    def add(self, slots: np.ndarray, windows: np.ndarray) -> None:
        """One window per slot as `window_table` counts them [R, 2, K]. A depth's evidence decays only in the
        windows that try it (a window of no drafts changes nothing).

        NOTE: a window that does not reach a depth says nothing about it. Decayed by every window, a
        request's evidence at depth 2 was gone ~20 windows into a spell at depth 1, its estimate fell back
        to the instance's (which gaps in the depth's MTP KV keep from learning): on 1024-token outputs at
        four streams the policy priced depth 2 at 2.3 tokens a window where its windows emitted 2.65, and
        stayed at depth 1 for a quarter of the steps (0.89 of k=2)."""
        decay = 1.0 - (1.0 - self.decay) * windows[:, :1]  # [R, 1, K]: the decay where tried, else 1
        self.counts[slots] = self.counts[slots] * decay + windows

    def add_window(self, slot: int, num_drafts: int, num_accepted: int) -> None:
        """One slot's window, as `add` counts it, in place in the slot's row (a step of a few rows)."""
        counts = self.counts[slot]  # [2, K], a view
        counts *= self._decays[num_drafts, num_accepted]
        counts += window_table(self.tried.shape[1])[num_drafts, num_accepted]

    def fade(self, slots: np.ndarray, factor: float) -> None:
        """Weaken these slots' evidence without adding any (their estimates drift back to the prior)."""
        self.counts[slots] *= factor

    def fade_depths(self, slots: np.ndarray, depths: np.ndarray, factor: float) -> None:
        """Weaken these slots' evidence at some depths (`depths` [R, K], True where) without adding any."""
        self.counts[slots] *= np.where(depths, factor, 1.0)[:, None, :]

    def rates(self, slots: np.ndarray, prior: np.ndarray) -> np.ndarray:
        """[R, K] conditional acceptance per depth of these slots' requests."""
        # NOTE: a hope is for one depth only, the first the instance doubts (its estimate below the first
        # prior): the depths before it are trusted, and a window is accepted or not there before any deeper
        # draft is worth trying. It counts for one window: at four, ten windows of nothing accepted (all a
        # decay of 0.9 keeps) still left 0.2 at depth 1 and the first prior's 0.7 deeper, and a hopeful
        # request at one stream drafted all its life where nothing was accepted.
        hopeful = self.hopeful[slots, None] & (np.arange(self.tried.shape[1]) == first_doubt(prior))
        weight = np.where(hopeful, self.HOPE_WEIGHT, DepthAcceptance.PRIOR_WEIGHT)
        prior = np.where(hopeful, np.maximum(prior, DepthAcceptance.FIRST_PRIOR), prior)
        counts = self.counts[slots]
        return (counts[:, 1] + weight * prior) / (counts[:, 0] + weight)

    def hoping(self, slots: np.ndarray, drafts: np.ndarray, prior: np.ndarray) -> bool:
        """Whether a hopeful one of these slots' requests drafts [R] as deep as the depth it hopes for
        (none does where the instance doubts no depth: there the hope changes nothing)."""
        return bool((self.hopeful[slots] & (drafts > first_doubt(prior))).any())


def first_doubt(prior: np.ndarray) -> int:
    """The first depth whose estimate is below the first prior (K if none is).

    NOTE: where the instance doubts depth d+1 but trusts the depths before it, the policy stays at depth
    d, whose windows never try depth d+1, and new prompts get no MTP KV at d+1, so nothing would teach the
    instance again: at one stream, ten windows of one request whose second drafts were all rejected (the
    content, not the depth) held the next 2,000 steps at depth 1 where depth 2 emitted 12% more a second."""
    doubted = np.flatnonzero(prior < DepthAcceptance.FIRST_PRIOR)
    return int(doubted[0]) if doubted.size else prior.shape[0]
