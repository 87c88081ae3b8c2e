"""How long a decision of the speculation policy holds (speculation.py): deciding costs ~150-250 us of
Python, and the step's thread waits for the GIL meanwhile, so at a steady load the policy decides once in a
few steps and keeps the depth (or, while the rows are the same, the very drafts) in between. The last decision at
each count of emitting rows is kept too: when the rows come back to that count within twice its length, it holds
again for the steps it has left (speculation.Speculation._resume).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from mtpserve.engine.spec_extra import ServingExtra

HOLD_STEPS = 8  # steps a decision holds while about as many rows emit (the same half octave)
# NOTE: a decision that repeats the one before it at exactly as many rows holds twice as long, up to
# MAX_HOLD_STEPS: a full decision costs ~150-250 us of Python, and the step's thread waits for the GIL
# meanwhile; at 16 rows, one every 8 steps was 1-2% of the engine's throughput where the depth never changed.
# A load that leaves the half octave, or a hope, still ends a hold at once.
MAX_HOLD_STEPS = 64


def same_load(held: int, now: int) -> bool:
    """Whether a decision made at `held` emitting rows still holds at `now`: the same half octave of rows
    (as `ServingExtra` measures them).

    NOTE: at 16-64 streams the rows that emit change almost every step (a prompt's middle chunk does not
    emit, its last one does; a request finishes), and a decision at each change was most of the policy's
    host work."""
    return ServingExtra.bucket(held) == ServingExtra.bucket(now)


def hold_length(held: Hold | None, depth: int, num_emitting: int, clear: bool) -> int:
    """Steps a new decision holds for: HOLD_STEPS, or twice the last one's if it decided the same depth at
    exactly as many rows, or within the half octave when the choice is `clear` (spec_policy.is_clear);
    MAX_HOLD_STEPS at most.

    NOTE: not within the half octave for every choice: doubled there too, a marginal choice of depth 2 at
    ~16 rows held for up to 64 steps, and adaptive drafted 2 deep for 20-24% of rows in two of three rounds
    at 16 streams on code (0.91 of k=1); doubled only at exactly as many rows, 0% and 0.98-1.00 of k=1 in
    three rounds. But at 16-64 streams the rows that emit are seldom exactly as many twice, so every
    decision held HOLD_STEPS: at 64 rows drafting nothing (random words), a decision every ~8 steps at
    ~400-500 us was half the policy's host work, and the engine served 0.98 of k=0."""
    if held is not None and held.depth == depth and (
            held.num_emitting == num_emitting or clear and same_load(held.num_emitting, num_emitting)):
        return min(2 * held.length, MAX_HOLD_STEPS)
    return HOLD_STEPS


@dataclasses.dataclass
class Hold:
    """A decision of the policy and the steps it still holds for: its depth and slot cost while about as many
    rows emit (`same_load`), its drafts while the rows are the same (`key`: their slots and whether each
    emits, as the arrays' bytes)."""

    num_emitting: int
    steps: int
    depth: int
    slot_cost: float
    length: int  # the steps it held for when decided
    at: int = 0  # the policy's steps when decided
    sought: bool = False  # a seek's: its depth is run to price its decode steps (Speculation._seek_price)
    key: tuple[bytes, bytes] = (b"", b"")
    drafts: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int64))
