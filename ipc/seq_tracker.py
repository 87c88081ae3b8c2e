"""Per-request token counters that prove nothing was lost or duplicated between engine and reader.

Each token frame says, per request, `seq` = tokens of that request sent before this frame. The tracker
keeps the count it saw so far for every live request (sorted arrays, so one frame is a handful of
vectorised NumPy calls, no per-request Python) and flags rows whose seq differs.
"""

from __future__ import annotations

import numpy as np

from mtpserve.ipc import wire
from mtpserve.ipc.token_frame import TokenFrame

# [finish value] -> the request is over and forgotten (PREEMPTED requests resume at the same seq)
_IS_DONE = np.zeros(int(max(wire.Finish)) + 1, bool)
_IS_DONE[[wire.Finish.STOP, wire.Finish.LENGTH, wire.Finish.ABORT, wire.Finish.ERROR]] = True


class SeqTracker:
    """Expected next seq per request id. A request not seen before must start at seq 0 unless
    expect() registered another start (a decode instance whose first token came from prefill)."""

    def __init__(self) -> None:
        self._ids = np.empty(0, np.int64)  # sorted request ids
        self._next = np.empty(0, np.int64)  # tokens seen so far, per id
        # NOTE: decode steps repeat the previous frame's batch; for that case the counts live in
        # frame order (hot) and reach the sorted table only when the batch changes.
        self._hot_ids: np.ndarray | None = None  # [B] the last frame's ids (unique, none finished)
        self._hot_next: np.ndarray | None = None  # [B] their counts
        # NOTE: expect()/forget() may come from another thread than check() (the SysV reader
        # thread runs check): they queue here (list.append is atomic) and check() applies them.
        self._pending: list[tuple[int, int | None]] = []

    def __len__(self) -> int:
        self._apply_pending()
        return int(self._ids.size)

    def expect(self, req_id: int, start: int) -> None:
        """Request `req_id`'s first frame will carry seq `start`; call before the request is sent."""
        self._pending.append((req_id, start))

    def forget(self, req_id: int) -> None:
        """Drop a request that will send no finishing frame (e.g. the engine refused it)."""
        self._pending.append((req_id, None))

    def _apply_pending(self) -> None:
        self._cool()
        while self._pending:
            req_id, start = self._pending.pop(0)
            ids = np.array([req_id], np.int64)
            if start is None:
                self._forget(ids)
            else:
                self._upsert(ids, np.array([start], np.int64))

    def check(self, frame: TokenFrame) -> np.ndarray:
        """[B] bool: row i carries the seq the tracker expected. Then advances (resyncing wrong
        rows, so one loss is reported once) and forgets finished requests."""
        if self._pending:
            self._apply_pending()
        done = _IS_DONE[frame.finish]
        seq = frame.seq.astype(np.int64)
        hot = self._hot_ids
        if hot is not None and hot.size == frame.req_ids.size and np.array_equal(hot, frame.req_ids) \
                and not done.any():
            ok = seq == self._hot_next
            self._hot_next = seq + frame.num_tokens
            return ok
        self._cool()
        ok = self._check_cold(frame, seq, done)
        if ok.all() and not done.any():
            self._hot_ids, self._hot_next = frame.req_ids.copy(), seq + frame.num_tokens
        return ok

    def _cool(self) -> None:
        """Write the hot counts back into the sorted table."""
        if self._hot_ids is not None and self._hot_next is not None:
            self._upsert(self._hot_ids, self._hot_next)
            self._hot_ids = self._hot_next = None

    def _check_cold(self, frame: TokenFrame, seq: np.ndarray, done: np.ndarray) -> np.ndarray:
        ids = frame.req_ids
        pos, found = self._lookup(ids)
        expected = np.zeros(ids.size, np.int64)
        expected[found] = self._next[pos[found]]
        ok = (seq == expected) & _first_occurrence(ids)
        self._next[pos[found]] = seq[found] + frame.num_tokens[found]
        if not found.all():
            self._insert(ids[~found], (seq + frame.num_tokens)[~found])
        if done.any():
            self._forget(ids[done])
        return ok

    def _lookup(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Positions of ids in the sorted table and whether each is there."""
        pos = np.searchsorted(self._ids, ids)
        if not self._ids.size:
            return pos, np.zeros(ids.size, bool)
        clipped = np.minimum(pos, self._ids.size - 1)
        return clipped, self._ids[clipped] == ids

    def _upsert(self, ids: np.ndarray, values: np.ndarray) -> None:
        pos, found = self._lookup(ids)
        self._next[pos[found]] = values[found]
        if not found.all():
            self._insert(ids[~found], values[~found])

    def _insert(self, ids: np.ndarray, values: np.ndarray) -> None:
        new_ids, first = np.unique(ids, return_index=True)
        merged = np.concatenate([self._ids, new_ids])
        order = np.argsort(merged, kind="stable")
        self._ids = merged[order]
        self._next = np.concatenate([self._next, values[first]])[order]

    def _forget(self, ids: np.ndarray) -> None:
        pos, found = self._lookup(ids)
        keep = np.ones(self._ids.size, bool)
        keep[pos[found]] = False
        self._ids, self._next = self._ids[keep], self._next[keep]


def _first_occurrence(ids: np.ndarray) -> np.ndarray:
    """[B] bool: False for a request id repeated within one frame (a duplicate)."""
    order = np.argsort(ids, kind="stable")
    repeat = np.zeros(ids.size, bool)
    repeat[order[1:]] = ids[order[1:]] == ids[order[:-1]]
    return ~repeat
