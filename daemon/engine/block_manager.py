"""Paged KV block accounting: reference-counted fixed-size blocks, which of them the prefix cache holds
(its index of them by hash: block_index.py).

A block is in one of four states:
  * free: on the free heap, never held since start-up or since the prefix cache was reset;
  * used: `refs > 0` block tables hold it (a cached block may be held by several requests);
  * released: no table holds it any more; it stays in release order, cached (its content indexed by a
    hash: *evictable*) or not. It counts as free: taking a block when the free heap is empty takes the
    least recently released block (evicting it if cached), except that a growing table takes the block
    right after its last one when that one is released and uncached, or cached and among the older half
    of them (`_continues_cheaply`), and a table
    that takes several of a run released together takes them lowest first (`take(after=..., wanted=...)`:
    runs of consecutive blocks). A growing table also takes the free block right after its last one
    before the lowest free id;
  * claimed: free or released, kept for the table whose last block is right before it: a
    table that starts a run for a request that will grow (`grow(expected_tokens=...)`) claims the blocks
    after the ones it takes, up to MAX_CLAIM_BLOCKS, and grows into them. Claims are soft: other tables
    take none while unclaimed ones remain, and a claim ends with its table or where another took a block.
Only full blocks whose KV a finished step wrote are cached (`register`), and a request writes only into
blocks it alone holds, so a cached block's content never changes while it is indexed.
"""

from __future__ import annotations

import collections
import heapq
import itertools

from mtpserve.engine.block_index import BlockIndex, CachedKV


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


# NOTE: growth room a new run claims beyond the blocks it takes now (`grow(expected_tokens=...)`): at 64 streams a
# table of a 256-token prompt grows by two blocks, and a claim per table as long as max_tokens allows could hold
# most of a pool
MAX_CLAIM_BLOCKS = 8
# NOTE: released blocks, oldest first, that a new run may be built around once the free heap is empty: the
# first whose run is long enough is taken, else the longest (a few us each)
RUN_CANDIDATES = 32


class BlockManager:
    """Owns the ids `0 .. num_blocks-1`.

    NOTE: pure host accounting. The device reads block tables (and applies block copies) that the engine
    copies with each step, so freeing or evicting here while a launched step still reads or writes the
    old content is safe: the device runs steps in launch order, copies before the forward pass, and any
    new owner's writes come in the same step's forward pass or later.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # NOTE: a min-heap, lowest id first, so a request's blocks tend to be consecutive: a PD KV read
        # is one copy per run of consecutive blocks, and each copy costs ~60 us over TCP. The set says which
        # ids are free; the heap may also hold ids taken since out of order (`take`), skipped on pop.
        self._free: list[int] = list(range(num_blocks))
        self._free_set: set[int] = set(self._free)
        self._refs = [0] * num_blocks
        # NOTE: oldest first; each value is the block's release tick (`_clock` at `free`), how old it is.
        # Uncached blocks stay in this order too, beside the cached ones a table released with them: with
        # k >= 2 a request's decode blocks are never cached, and on the free heap they came back as single
        # ids that split every table that took them (`free`)
        self._released: collections.OrderedDict[int, int] = collections.OrderedDict()
        self._num_uncached_released = 0
        # NOTE: a claimed block's release tick (None if it was free) and its claim's serial; a claim is keyed by
        # its table's last block, with its end (exclusive) and serial (`take`, `_start_run`)
        self._claimed: dict[int, tuple[int | None, int]] = {}
        self._claim_end: dict[int, tuple[int, int]] = {}
        self._claim_serial = 0
        self._num_cached_claimed = 0  # NOTE: a claimed cached block stays matchable until its table takes it
        self._clock = 0
        self._index = BlockIndex()  # NOTE: the prefix cache's: which blocks are cached, by hash

    # ---- counts ---------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks a request can take: free, plus released ones (a cached one is evicted on demand)."""
        return len(self._free_set) + len(self._released) + len(self._claimed)

    @property
    def num_claimed_blocks(self) -> int:
        """Free or released blocks a table's run keeps for it to grow into."""
        return len(self._claimed)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._index)

    @property
    def num_evictable_blocks(self) -> int:
        """Cached blocks no table holds."""
        return len(self._released) - self._num_uncached_released + self._num_cached_claimed

    def refs(self, block: int) -> int:
        return self._refs[block]

    # ---- taking and releasing -------------------------------------------------------------------

    def num_missing(self, block_ids: list[int], num_tokens: int) -> int:
        """How many more blocks a table needs to hold `num_tokens` token slots."""
        return max(0, blocks_for(num_tokens, self.block_size) - len(block_ids))

    def can_grow(self, block_ids: list[int], num_tokens: int) -> bool:
        return self.num_missing(block_ids, num_tokens) <= self.num_free_blocks

    def grow(self, block_ids: list[int], num_tokens: int, expected_tokens: int = 0) -> list[int]:
        """Append blocks to `block_ids` (in place) to cover `num_tokens`; returns the new ones. `expected_tokens`:
        what the table may come to hold in all (its request's prompt and max_tokens): a run it starts claims
        room for that, up to MAX_CLAIM_BLOCKS beyond what it takes now."""
        missing = self.num_missing(block_ids, num_tokens)
        if not missing:
            return []  # NOTE: the usual case (every running row, every step)
        if missing > self.num_free_blocks:
            raise MemoryError(f"need {missing} KV blocks, {self.num_free_blocks} free")
        new: list[int] = []
        last = block_ids[-1] if block_ids else None
        room = min(self.num_missing(block_ids, expected_tokens), missing + MAX_CLAIM_BLOCKS)
        for i in range(missing):
            last = self.take(after=last, wanted=missing - i, room=room - i)
            new.append(last)
        block_ids.extend(new)
        return new

    def take(self, after: int | None = None, wanted: int = 1, room: int = 0) -> int:
        """One block for a table to write into: the block right after `after` (the table's last one) if the
        table claimed it, or it is free, or released and uncached, or old when none is free
        (`_continues_cheaply`); else, when the table expects to take more blocks than this one (`room`, this
        one included), the start of a new run (`_find_run`); else the lowest free one; else the least
        recently released one, or, when the table wants more blocks than this one (`wanted`, this one
        included) and the blocks below it were released with it, the lowest of those that the table will
        take anyway (`_run_start`); else one another table claimed. A block that continues or starts a run
        claims the blocks after it, up to `room` (`_start_run`). A cached block taken leaves the cache, so
        none does while free ones remain, but for a run's sake (`_takable`).

        NOTE: the block after a table's last one first, because CPU attention reads a table's blocks in
        order and scattered ones cost it 1.22-1.27x (`_continues_run`). The free heap holds only blocks no
        table has held (`free` says why), so the lowest free id starts the pool's untouched rest."""
        nxt = None if after is None else after + 1
        if after is not None and after in self._claim_end and self._take_claimed(after):
            block = after + 1  # NOTE: the claim moved on to it
        elif nxt is not None and (nxt in self._free_set or self._continues_cheaply(nxt)):
            block = self._start_run(room, nxt)
        elif room > 1 and (self._free_set or self._released):
            block = self._start_run(room)
        elif self._free_set:
            block = self._pop_free()
        elif self._released:
            block = self._run_start(next(iter(self._released)), wanted)
            self._reuse(block)
        elif self._claimed:
            block = next(iter(self._claimed))
            self._unclaim_one(block)  # NOTE: its claim now ends there (`_take_claimed`)
            self._reuse(block)
        else:
            raise MemoryError("no free KV block")
        self._refs[block] = 1
        return block

    def _take_claimed(self, after: int) -> bool:
        """The block after a table's last one (`after`) leaves the table's claim for it, the rest of the claim
        moving on to it; False (the claim dropped) when another table took that block meanwhile."""
        end, serial = self._claim_end.pop(after)
        block = after + 1
        if self._claimed.get(block, (None, -1))[1] != serial:
            self._unclaim(block, end, serial)
            return False
        self._unclaim_one(block)
        self._reuse(block)
        if block + 1 < end:
            self._claim_end[block] = (end, serial)
        return True

    def _continues_cheaply(self, block: int) -> bool:
        """Whether a table whose last block is right before this one takes it before any free one: it is
        released and uncached (taking it evicts nothing), or no block is free and it is old
        (`_continues_run`)."""
        if block not in self._released:
            return False
        return block not in self._index or not self._free_set and self._continues_run(block)

    def _start_run(self, room: int, start: int | None = None) -> int:
        """The first block of a run of up to `room` consecutive blocks, the rest of which the table claims:
        `start`, or where `_find_run` finds one.

        NOTE: CPU attention reads a table's blocks in order, and scattered ones cost it 1.24-1.38x
        (`mtpserve bench attention --layouts`). Without claims, the next table took the blocks right after a
        new one's prompt, and it grew elsewhere; and once the pool had cycled, a table took the oldest
        released block, and whatever came after it: in a scheduler replay at 64 streams, 43-48% of the
        prompt's neighbouring blocks and 58-83% of those it grew into were not consecutive. A K=3 instance,
        whose pool is 0.57x k=0's, cycled it sooner: 0.62 of its running tables' neighbouring blocks were
        consecutive against k=0's 0.71, and its decode steps took 2-5% longer."""
        if start is None:
            start = self._find_run(room)[0]
        if start in self._free_set:
            self._free_set.remove(start)
        else:
            self._reuse(start)
        self._claim_serial += 1
        end = start + 1
        while end < start + room and self._claim(end, self._claim_serial):
            end += 1
        if end > start + 1:
            self._claim_end[start] = (end, self._claim_serial)
        return start

    def _find_run(self, room: int) -> tuple[int, int]:
        """A block that starts `room` consecutive takable ones, or the longest run found: the lowest free id
        while any is free (the pool's untouched rest), else around one of the RUN_CANDIDATES least recently
        released blocks. Returns its first block and how many (at most `room`)."""
        if self._free_set:
            while self._free[0] not in self._free_set:
                heapq.heappop(self._free)
            start = self._free[0]
            length = 1
            while length < room and start + length in self._free_set:
                length += 1
            return start, length
        best_start, best_length = -1, 0
        for block in itertools.islice(self._released, RUN_CANDIDATES):
            start = block
            while block - start < room - 1 and self._takable(start - 1):
                start -= 1
            length = 1
            while length < room and self._takable(start + length):
                length += 1
            if length == room:
                return start, length
            if length > best_length:
                best_start, best_length = start, length
        return best_start, best_length

    def _takable(self, block: int) -> bool:
        """Whether a run may take this released block: uncached, or cached and old (`_continues_run`)."""
        return block in self._released and (block not in self._index or self._continues_run(block))

    def _claim(self, block: int, serial: int) -> bool:
        """Claim a free block, or a released one a run may take (`_takable`), for claim `serial`; False if
        it is neither."""
        if block in self._free_set:
            self._free_set.remove(block)  # NOTE: its heap entry is skipped; `_unclaim` pushes it again
            self._claimed[block] = (None, serial)
            return True
        if not self._takable(block):
            return False
        self._claimed[block] = (self._released.pop(block), serial)
        if block in self._index:
            self._num_cached_claimed += 1
        else:
            self._num_uncached_released -= 1
        return True

    def _unclaim_one(self, block: int) -> int | None:
        """A claimed block leaves its claim, to be taken; returns its release tick (None if it was free) and
        puts it in the release order meanwhile (`_reuse` takes it from there)."""
        tick, _ = self._claimed.pop(block)
        if block in self._index:
            self._num_cached_claimed -= 1
        else:
            self._num_uncached_released += 1
        self._released[block] = self._clock if tick is None else tick
        return tick

    def _unclaim(self, first: int, end: int, serial: int) -> None:
        """The blocks `first .. end-1` that claim `serial` still holds go back to where they were."""
        for block in range(first, end):
            claimed = self._claimed.get(block)
            if claimed is None or claimed[1] != serial:
                continue
            if self._unclaim_one(block) is None:
                del self._released[block]
                self._num_uncached_released -= 1
                self._push_free(block)

    def _run_start(self, oldest: int, wanted: int) -> int:
        """The lowest of the blocks `oldest - wanted + 1 .. oldest` that were released with it, one tick apart.

        NOTE: `free` releases a table's blocks last first, so the least recently released block of a table
        is its last one, and a table that took blocks in that order held them in descending order: once the
        pool had cycled, 21-29% of the running tables' neighbouring blocks were consecutive in a replay (K=3,
        16 streams). Starting at the lowest of them, the next takes continue upwards (`_continues_run`) and
        evict the same blocks as in LRU order."""
        block, tick = oldest, self._released[oldest]
        while wanted > 1 and self._released.get(block - 1) == tick + 1:
            block, tick, wanted = block - 1, tick + 1, wanted - 1
        return block

    def _pop_free(self) -> int:
        """The lowest free id (the heap's entries for ids taken out of order are dropped on the way)."""
        while True:
            block = heapq.heappop(self._free)
            if block in self._free_set:
                self._free_set.remove(block)
                return block

    def _reuse(self, block: int) -> None:
        """A released block leaves the release order for a table; a cached one leaves the cache."""
        del self._released[block]
        if block in self._index:
            self._index.remove(block)
        else:
            self._num_uncached_released -= 1

    def _push_free(self, block: int) -> None:
        self._free_set.add(block)
        heapq.heappush(self._free, block)
        if len(self._free) > 2 * len(self._free_set) + 64:
            self._free = sorted(self._free_set)  # NOTE: a sorted list is a heap

    def _continues_run(self, block: int) -> bool:
        """True if `block` is released and was released in the older half of the released ones' span.

        NOTE: CPU attention reads a table's blocks in order, and once the prefix cache has cycled the pool
        they lie anywhere in it: 64 decode rows over scattered 64-token blocks took 1.22-1.27x as long as
        over consecutive ones (`mtpserve bench attention --layouts`). A table that grows into the block
        after its last one keeps a run; a scheduler replay at 64 streams found 3% of neighbouring blocks
        consecutive without this and 42% with it. Only older blocks, so that a prefix released recently
        (the likeliest to be matched again) still leaves in LRU order."""
        released = self._released.get(block)
        if released is None:
            return False
        oldest = next(iter(self._released.values()))
        return released - oldest <= (self._clock - oldest) // 2

    def share(self, block_ids: list[int]) -> None:
        """Another table holds these cached blocks (a prefix hit)."""
        for block in block_ids:
            if block not in self._index:
                raise ValueError(f"KV block {block} is not cached: it cannot be shared")
            if block in self._claimed:
                self._unclaim_one(block)  # NOTE: its claim now ends there (`_take_claimed`)
            if self._refs[block] == 0:
                del self._released[block]
            self._refs[block] += 1

    def free(self, block_ids: list[int]) -> None:
        """Release a table's blocks (and empty it). A cached block no table holds any more stays
        cached until evicted.

        NOTE: released last block first, so that under pressure a sequence's tail is evicted before
        its head: the head is the part other prompts share. Uncached blocks take their place in the
        order too: on the free heap, a K=3 instance's decode blocks (never cached) came back as single
        ids, and at 64 streams on code only 33% of the running tables' neighbouring blocks were
        consecutive, against 58% at k=0, whose every full block is cached; its decode steps' forward pass
        took 3% longer (docs/architecture.md, Runs of blocks)."""
        for block in reversed(block_ids):
            if self._refs[block] <= 0:
                raise ValueError(f"double free of KV block {block}")
            self._refs[block] -= 1
            if block in self._claim_end and self._refs[block] == 0:
                end, serial = self._claim_end.pop(block)
                self._unclaim(block + 1, end, serial)
            if self._refs[block] == 0:
                self._clock += 1
                self._released[block] = self._clock
                self._num_uncached_released += block not in self._index
        block_ids.clear()

    # ---- the prefix cache's index ---------------------------------------------------------------

    def lookup(self, block_hash: bytes, next_tokens: tuple[int, ...]) -> tuple[int, CachedKV] | None:
        """A cached block holding these tokens (`BlockIndex.lookup`)."""
        return self._index.lookup(block_hash, next_tokens)

    def register(self, block: int, block_hash: bytes, kv: CachedKV) -> bool:
        """Index a held, full block by its hash; True if a match can now find it (the blocks it replaces,
        `BlockIndex.displaced`, leave the cache)."""
        if self._refs[block] <= 0:
            raise ValueError(f"KV block {block} is not held: it cannot be cached")
        if block in self._index:
            return self._index.hash_of(block) == block_hash
        displaced = self._index.displaced(block_hash, kv)
        if displaced is None:
            return False
        for other in displaced:
            self._uncache(other)
        self._index.add(block, block_hash, kv)
        return True

    def reset_prefix_cache(self) -> int:
        """Forget every cached block: released ones become free (cached or not), held ones stay with their
        tables but are matched no more. Returns how many were forgotten."""
        forgotten = self._index.blocks()
        for block in forgotten:
            self._uncache(block)
        for block in self._released:
            self._push_free(block)
        self._released.clear()
        self._num_uncached_released = 0
        for block, (_, serial) in self._claimed.items():
            self._claimed[block] = (None, serial)
        return len(forgotten)

    def _uncache(self, block: int) -> None:
        """A block the index forgets; a released one keeps its place in the release order."""
        self._index.remove(block)
        self._num_uncached_released += block in self._released
        if block in self._claimed:
            self._num_cached_claimed -= 1

    def check(self) -> None:
        """Raise AssertionError unless the accounting is consistent (tests)."""
        free = self._free_set
        assert free <= set(self._free), "a free block is missing from the free heap"
        for block in range(self.num_blocks):
            in_free, released, claimed = block in free, block in self._released, block in self._claimed
            assert in_free + released + claimed + (self._refs[block] > 0) == 1, f"block {block} is in two states"
            assert not (in_free and block in self._index), f"free block {block} is still cached"
        assert sum(b in self._index for b in self._claimed) == self._num_cached_claimed, "cached claimed count"
        serials = {serial for _, serial in self._claim_end.values()}
        assert all(serial in serials for _, serial in self._claimed.values()), "a claimed block has no claim"
        assert all(self._refs[last] > 0 for last in self._claim_end), "a claim's table holds its last block no more"
        uncached = sum(block not in self._index for block in self._released)
        assert uncached == self._num_uncached_released, "uncached released count out of step"
        self._index.check()
