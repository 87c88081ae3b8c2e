"""Runs of consecutive KV blocks and the claims that keep them: a table that starts a run for a request that
will grow claims the free or released blocks after the ones it takes (block_pool.py's *claimed* state), and
grows into them (block_manager.py says when a table starts a run).

Claims are soft: other tables take no claimed block while an unclaimed one remains, and a claim ends with
its table, or where another table took one of its blocks.
"""

from __future__ import annotations

import itertools

from mtpserve.engine.block_pool import BlockPool

# NOTE: released blocks, oldest first, that a new run may be built around once the free heap is empty: the
# first whose run is long enough is taken, else the longest (a few us each)
RUN_CANDIDATES = 32


class Claims:
    """Each claim by its table's last block: the claim's end (exclusive) and serial (the pool's claimed blocks
    carry the serial of the claim that holds them)."""

    def __init__(self, pool: BlockPool) -> None:
        self._pool = pool
        self._end: dict[int, tuple[int, int]] = {}
        self._serial = 0

    def __contains__(self, last: int) -> bool:
        """Whether the table whose last block is `last` has a claim."""
        return last in self._end

    def take_claimed(self, after: int) -> bool:
        """The block after a table's last one (`after`) leaves the table's claim for it, the rest of the claim
        moving on to it; False (the claim dropped) when another table took that block meanwhile."""
        end, serial = self._end.pop(after)
        block = after + 1
        if self._pool.claimed.get(block, (None, -1))[1] != serial:
            self._give_back(block, end, serial)
            return False
        self._pool.unclaim(block)
        self._pool.reuse(block)
        if block + 1 < end:
            self._end[block] = (end, serial)
        return True

    def start_run(self, room: int, start: int | None = None) -> int:
        """The first block of a run of up to `room` consecutive blocks, the rest of which the table claims:
        `start`, or where `find_run` finds one.

        NOTE: CPU attention reads a table's blocks in order, and scattered ones cost it 1.24-1.38x
        (`mtpserve bench attention --layouts`). Without claims, the next table took the blocks right after a
        new one's prompt, and it grew elsewhere; and once the pool had cycled, a table took the oldest
        released block, and whatever came after it: in a scheduler replay at 64 streams, 43-48% of the
        prompt's neighbouring blocks and 58-83% of those it grew into were not consecutive. A K=3 instance,
        whose pool is 0.57x k=0's, cycled it sooner: 0.62 of its running tables' neighbouring blocks were
        consecutive against k=0's 0.71, and its decode steps took 2-5% longer."""
        pool = self._pool
        if start is None:
            start = self.find_run(room)[0]
        if start in pool.free_set:
            pool.free_set.remove(start)
        else:
            pool.reuse(start)
        self._serial += 1
        end = start + 1
        while end < start + room and pool.claim(end, self._serial):
            end += 1
        if end > start + 1:
            self._end[start] = (end, self._serial)
        return start

    def find_run(self, room: int) -> tuple[int, int]:
        """A block that starts `room` consecutive takable ones, or the longest run found: the lowest free id
        while any is free (the pool's untouched rest), else around one of the RUN_CANDIDATES least recently
        released blocks. Returns its first block and how many (at most `room`)."""
        pool = self._pool
        if pool.free_set:
            start = pool.lowest_free()
            length = 1
            while length < room and start + length in pool.free_set:
                length += 1
            return start, length
        best_start, best_length = -1, 0
        for block in itertools.islice(pool.released, RUN_CANDIDATES):
            start = block
            while block - start < room - 1 and pool.takable(start - 1):
                start -= 1
            length = 1
            while length < room and pool.takable(start + length):
                length += 1
            if length == room:
                return start, length
            if length > best_length:
                best_start, best_length = start, length
        return best_start, best_length

    def end(self, last: int) -> None:
        """The table whose last block is `last` is gone: its claim, if any, gives its blocks back."""
        claim = self._end.pop(last, None)
        if claim is not None:
            self._give_back(last + 1, *claim)

    def _give_back(self, first: int, end: int, serial: int) -> None:
        """The blocks `first .. end-1` that claim `serial` still holds go back to where they were."""
        for block in range(first, end):
            claimed = self._pool.claimed.get(block)
            if claimed is not None and claimed[1] == serial:
                self._pool.give_back(block)

    def check(self) -> None:
        """Raise AssertionError unless every claimed block has its claim, and every claim its table."""
        serials = {serial for _, serial in self._end.values()}
        assert all(serial in serials for _, serial in self._pool.claimed.values()), "a claimed block has no claim"
        assert all(self._pool.refs[last] > 0 for last in self._end), "a claim's table holds its last block no more"
