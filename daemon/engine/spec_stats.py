"""Speculation counters: drafts proposed and accepted, per draft position (host side, numpy)."""

from __future__ import annotations

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


def window_counts(num_drafts: np.ndarray, num_accepted: np.ndarray, max_drafts: int) -> tuple[np.ndarray, np.ndarray]:
    """Verified windows [R] -> ([R, K] depths tried, [R, K] depths accepted). Depth i of a window of n
    drafts was tried if the i drafts before it were accepted (i < n, i <= accepted) and accepted if
    accepted > i."""
    depth = np.arange(max_drafts)
    drafted = depth < num_drafts[:, None]
    return drafted & (depth <= num_accepted[:, None]), drafted & (depth < num_accepted[:, None])


class DepthAcceptance:
    """A running estimate of the chance that the draft at each depth is accepted, given that the drafts
    before it were: decayed counts of tries and acceptances per depth, shrunk towards a prior. The
    instance's, over every request's windows: the prior of a new request."""

    PRIOR_WEIGHT = 4.0  # windows' worth of evidence the prior counts for
    FIRST_PRIOR = 0.7  # before anything was seen: what trained MTP heads accept at depth 1, roughly

    def __init__(self, max_drafts: int, decay: float) -> None:
        self.tried = np.zeros(max_drafts)
        self.accepted = np.zeros(max_drafts)
        self.decay = decay  # per window

    def observe(self, num_drafts: np.ndarray, num_accepted: np.ndarray) -> None:
        """One step's windows [R] (windows of no drafts count for nothing)."""
        tried, accepted = window_counts(num_drafts, num_accepted, self.tried.shape[0])
        self.add(tried, accepted, int((num_drafts > 0).sum()))

    def add(self, tried: np.ndarray, accepted: np.ndarray, num_windows: int) -> None:
        """`window_counts` of a step's windows, `num_windows` of them (each decays what came before)."""
        factor = self.decay ** num_windows
        self.tried = self.tried * factor + tried.sum(axis=0)
        self.accepted = self.accepted * factor + accepted.sum(axis=0)

    def fade(self, factor: float) -> None:
        """Weaken the evidence without adding any (the estimate drifts back towards the prior)."""
        self.tried = self.tried * factor
        self.accepted = self.accepted * factor

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


class SlotAcceptance:
    """Each running request's estimate, as DepthAcceptance's, in one table by device slot: a step reads
    and updates all its rows in one numpy operation (per-request objects cost ~5 us a row a step, the
    policy's largest part at 64 rows). A request taking a slot starts from its prior alone; a hopeful
    one from at least the first prior at depth 1, which counts for a single window."""

    HOPE_WEIGHT = 1.0

    def __init__(self, num_slots: int, max_drafts: int, decay: float) -> None:
        self.tried = np.zeros((num_slots, max_drafts))  # [S, K]
        self.accepted = np.zeros((num_slots, max_drafts))
        self.hopeful = np.zeros(num_slots, bool)  # [S] the request's prior is at least the first prior
        self.decay = decay  # per window of the slot's request

    def reset(self, slots: np.ndarray, hopeful: np.ndarray | bool = False) -> None:
        self.tried[slots] = 0.0
        self.accepted[slots] = 0.0
        self.hopeful[slots] = hopeful

    def observe(self, slots: np.ndarray, num_drafts: np.ndarray, num_accepted: np.ndarray) -> None:
        """One step's windows [R] of distinct slots, each of at least one draft."""
        self.add(slots, *window_counts(num_drafts, num_accepted, self.tried.shape[1]))

    def add(self, slots: np.ndarray, tried: np.ndarray, accepted: np.ndarray) -> None:
        """`window_counts` of one window per slot. A depth's evidence decays only in the windows that try it.

        NOTE: a window that does not reach a depth says nothing about it. Decayed by every window, a
        request's evidence at depth 2 was gone ~20 windows into a spell at depth 1, its estimate fell back
        to the instance's (which gaps in the depth's MTP KV keep from learning): on 1024-token outputs at
        four streams the policy priced depth 2 at 2.3 tokens a window where its windows emitted 2.65, and
        stayed at depth 1 for a quarter of the steps (0.89 of k=2)."""
        decay = np.where(tried, self.decay, 1.0)
        self.tried[slots] = self.tried[slots] * decay + tried
        self.accepted[slots] = self.accepted[slots] * decay + accepted

    def fade(self, slots: np.ndarray, factor: float) -> None:
        """Weaken these slots' evidence without adding any (their estimates drift back to the prior)."""
        self.tried[slots] *= factor
        self.accepted[slots] *= factor

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
        return (self.accepted[slots] + weight * prior) / (self.tried[slots] + weight)

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
