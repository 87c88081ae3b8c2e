"""The state of every KV block and the moves between states: the block manager's (block_manager.py) and its
runs' and claims' (block_claims.py) shared ground.

A block is in one of four states:
  * free: on the free heap, never held since start-up or since the prefix cache was reset;
  * used: `refs > 0` block tables hold it (a cached block may be held by several requests);
  * released: no table holds it any more; it stays in release order, cached (its content indexed by a
    hash: *evictable*) or not. It counts as free (a cached one is evicted when taken);
  * claimed: free or released, kept for the table whose last block is right before it (block_claims.py).
"""

from __future__ import annotations

import collections
import heapq

from mtpserve.engine.block_index import BlockIndex


class BlockPool:
    """The ids `0 .. num_blocks-1`, each in one state; which of them are cached is the index's (`index`)."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        # NOTE: a min-heap, lowest id first, so a request's blocks tend to be consecutive: a PD KV read
        # is one copy per run of consecutive blocks, and each copy costs ~60 us over TCP. The set says which
        # ids are free; the heap may also hold ids taken since out of order, skipped on pop.
        self.free: list[int] = list(range(num_blocks))
        self.free_set: set[int] = set(self.free)
        self.refs = [0] * num_blocks
        # NOTE: oldest first; each value is the block's release tick (`clock` at `release`), how old it is.
        # Uncached blocks stay in this order too, beside the cached ones a table released with them: with
        # k >= 2 a request's decode blocks are never cached, and on the free heap they came back as single
        # ids that split every table that took them (BlockManager.free)
        self.released: collections.OrderedDict[int, int] = collections.OrderedDict()
        self.num_uncached_released = 0
        # NOTE: a claimed block's release tick (None if it was free) and its claim's serial (block_claims.py)
        self.claimed: dict[int, tuple[int | None, int]] = {}
        self.num_cached_claimed = 0  # NOTE: a claimed cached block stays matchable until its table takes it
        self.clock = 0
        self.index = BlockIndex()  # NOTE: the prefix cache's: which blocks are cached, by hash

    @property
    def num_free(self) -> int:
        """Blocks a request can take: free, released and claimed."""
        return len(self.free_set) + len(self.released) + len(self.claimed)

    @property
    def num_evictable(self) -> int:
        """Cached blocks no table holds."""
        return len(self.released) - self.num_uncached_released + self.num_cached_claimed

    # ---- free <-> taken ---------------------------------------------------------------------------

    def pop_free(self) -> int:
        """The lowest free id, taken."""
        block = self.lowest_free()
        heapq.heappop(self.free)
        self.free_set.remove(block)
        return block

    def lowest_free(self) -> int:
        """The lowest free id, left free (there must be one; the heap's entries for ids taken out of order
        are dropped on the way)."""
        while self.free[0] not in self.free_set:
            heapq.heappop(self.free)
        return self.free[0]

    def push_free(self, block: int) -> None:
        self.free_set.add(block)
        heapq.heappush(self.free, block)
        if len(self.free) > 2 * len(self.free_set) + 64:
            self.free = sorted(self.free_set)  # NOTE: a sorted list is a heap

    # ---- released <-> taken -----------------------------------------------------------------------

    def release(self, block: int) -> None:
        """A block no table holds any more joins the release order, newest."""
        self.clock += 1
        self.released[block] = self.clock
        self.num_uncached_released += block not in self.index

    def reuse(self, block: int) -> None:
        """A released block leaves the release order for a table; a cached one leaves the cache."""
        del self.released[block]
        if block in self.index:
            self.index.remove(block)
        else:
            self.num_uncached_released -= 1

    def run_start(self, oldest: int, wanted: int) -> int:
        """The lowest of the blocks `oldest - wanted + 1 .. oldest` that were released with it, one tick apart.

        NOTE: `BlockManager.free` releases a table's blocks last first, so the least recently released block
        of a table is its last one, and a table that took blocks in that order held them in descending order:
        once the pool had cycled, 21-29% of the running tables' neighbouring blocks were consecutive in a
        replay (K=3, 16 streams). Starting at the lowest of them, the next takes continue upwards
        (`continues_run`) and evict the same blocks as in LRU order."""
        block, tick = oldest, self.released[oldest]
        while wanted > 1 and self.released.get(block - 1) == tick + 1:
            block, tick, wanted = block - 1, tick + 1, wanted - 1
        return block

    def continues_run(self, block: int) -> bool:
        """True if `block` is released and was released in the older half of the released ones' span.

        NOTE: CPU attention reads a table's blocks in order, and once the prefix cache has cycled the pool
        they lie anywhere in it: 64 decode rows over scattered 64-token blocks took 1.22-1.27x as long as
        over consecutive ones (`mtpserve bench attention --layouts`). A table that grows into the block
        after its last one keeps a run; a scheduler replay at 64 streams found 3% of neighbouring blocks
        consecutive without this and 42% with it. Only older blocks, so that a prefix released recently
        (the likeliest to be matched again) still leaves in LRU order."""
        released = self.released.get(block)
        if released is None:
            return False
        oldest = next(iter(self.released.values()))
        return released - oldest <= (self.clock - oldest) // 2

    def takable(self, block: int) -> bool:
        """Whether a run may take this released block: uncached, or cached and old (`continues_run`)."""
        return block in self.released and (block not in self.index or self.continues_run(block))

    # ---- free or released <-> claimed -------------------------------------------------------------

    def claim(self, block: int, serial: int) -> bool:
        """Claim a free block, or a released one a run may take (`takable`), for claim `serial`; False if
        it is neither."""
        if block in self.free_set:
            self.free_set.remove(block)  # NOTE: its heap entry is skipped; `give_back` pushes it again
            self.claimed[block] = (None, serial)
            return True
        if not self.takable(block):
            return False
        self.claimed[block] = (self.released.pop(block), serial)
        if block in self.index:
            self.num_cached_claimed += 1
        else:
            self.num_uncached_released -= 1
        return True

    def unclaim(self, block: int) -> None:
        """A claimed block leaves its claim, to be taken: it waits in the release order meanwhile (`reuse`
        takes it from there), with its old release tick (the clock's now if it was free)."""
        tick, _ = self.claimed.pop(block)
        if block in self.index:
            self.num_cached_claimed -= 1
        else:
            self.num_uncached_released += 1
        self.released[block] = self.clock if tick is None else tick

    def give_back(self, block: int) -> None:
        """A claimed block goes back to where it was: the free heap, or the release order."""
        tick, _ = self.claimed[block]
        if tick is None:
            del self.claimed[block]
            self.push_free(block)
        else:
            self.unclaim(block)

    def share(self, block: int) -> None:
        """One more table holds this cached block (a prefix hit), from whatever state it was in."""
        if block in self.claimed:
            self.unclaim(block)  # NOTE: its claim now ends there (`Claims.take_claimed`)
        if self.refs[block] == 0:
            del self.released[block]  # NOTE: cached, so not among the uncached released
        self.refs[block] += 1

    # ---- the cache --------------------------------------------------------------------------------

    def uncache(self, block: int) -> None:
        """A block the index forgets; a released one keeps its place in the release order."""
        self.index.remove(block)
        self.num_uncached_released += block in self.released
        if block in self.claimed:
            self.num_cached_claimed -= 1

    def forget_cache(self) -> int:
        """Every cached block forgotten, every released block free again; returns how many were cached."""
        forgotten = self.index.blocks()
        for block in forgotten:
            self.uncache(block)
        for block in self.released:
            self.push_free(block)
        self.released.clear()
        self.num_uncached_released = 0
        for block, (_, serial) in self.claimed.items():
            self.claimed[block] = (None, serial)
        return len(forgotten)

    def check(self) -> None:
        """Raise AssertionError unless the states are consistent (tests)."""
        free = self.free_set
        assert free <= set(self.free), "a free block is missing from the free heap"
        for block in range(self.num_blocks):
            in_free, released, claimed = block in free, block in self.released, block in self.claimed
            assert in_free + released + claimed + (self.refs[block] > 0) == 1, f"block {block} is in two states"
            assert not (in_free and block in self.index), f"free block {block} is still cached"
        assert sum(b in self.index for b in self.claimed) == self.num_cached_claimed, "cached claimed count"
        uncached = sum(block not in self.index for block in self.released)
        assert uncached == self.num_uncached_released, "uncached released count out of step"
