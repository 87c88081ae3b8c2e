"""Paged KV block accounting: reference-counted fixed-size blocks, and the prefix cache's index of them.

A block is in one of three states:
  * free: on the free heap, never held since start-up or since the prefix cache was reset;
  * used: `refs > 0` block tables hold it (a cached block may be held by several requests);
  * released: no table holds it any more; it stays in release order, cached (its content indexed by a
    hash: *evictable*) or not. It counts as free: taking a block when the free heap is empty takes the
    least recently released block (evicting it if cached), except that a growing table takes the block
    right after its last one when that one is released and among the older half of them, and a table
    that takes several of a run released together takes them lowest first (`take(after=..., wanted=...)`:
    runs of consecutive blocks). A growing table also takes the free block right after its last one
    before the lowest free id.
Only full blocks whose KV a finished step wrote are cached (`register`), and a request writes only into
blocks it alone holds, so a cached block's content never changes while it is indexed.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


@dataclasses.dataclass(frozen=True)
class CachedKV:
    """What a cached block's content depends on beyond the tokens its hash covers
    (docs/prefix-caching.md).

    `lookahead`: the tokens past the block's end that its MTP KV read (MTP depth i at position t reads
    the token at t+i+1), k of them; None when some were drafts. A block is reused inside a match only
    when the new request has these same tokens there; otherwise it may end a match, whose last k
    positions are recomputed anyway.
    `mtp_depths`: the MTP depths that ran over it (fewer under adaptive speculation: deeper depths left
    gaps, which a request that matches it inherits as if it had run those steps itself).
    """

    lookahead: tuple[int, ...] | None
    mtp_depths: int

    def better_than(self, other: CachedKV) -> bool:
        """Of two blocks with the same tokens that a match could use in the same places."""
        return (self.lookahead is not None, self.mtp_depths) > (other.lookahead is not None, other.mtp_depths)


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
        self._clock = 0
        self._hash_of: dict[int, bytes] = {}
        # NOTE: several blocks may share a hash, one per lookahead (the same prefix, continued differently)
        self._blocks_of: dict[bytes, dict[int, CachedKV]] = {}

    # ---- counts ---------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks a request can take: free, plus released ones (a cached one is evicted on demand)."""
        return len(self._free_set) + len(self._released)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._hash_of)

    @property
    def num_evictable_blocks(self) -> int:
        """Cached blocks no table holds."""
        return len(self._released) - self._num_uncached_released

    def refs(self, block: int) -> int:
        return self._refs[block]

    # ---- taking and releasing -------------------------------------------------------------------

    def num_missing(self, block_ids: list[int], num_tokens: int) -> int:
        """How many more blocks a table needs to hold `num_tokens` token slots."""
        return max(0, blocks_for(num_tokens, self.block_size) - len(block_ids))

    def can_grow(self, block_ids: list[int], num_tokens: int) -> bool:
        return self.num_missing(block_ids, num_tokens) <= self.num_free_blocks

    def grow(self, block_ids: list[int], num_tokens: int) -> list[int]:
        """Append blocks to `block_ids` (in place) to cover `num_tokens`; returns the new ones."""
        missing = self.num_missing(block_ids, num_tokens)
        if missing > self.num_free_blocks:
            raise MemoryError(f"need {missing} KV blocks, {self.num_free_blocks} free")
        new: list[int] = []
        last = block_ids[-1] if block_ids else None
        for i in range(missing):
            last = self.take(after=last, wanted=missing - i)
            new.append(last)
        block_ids.extend(new)
        return new

    def take(self, after: int | None = None, wanted: int = 1) -> int:
        """One block for a table to write into: the block right after `after` (the table's last one) if it
        is free; else the lowest free one; else the block after `after` when it is an old released one
        (`_continues_run`); else the least recently released one, or, when the table wants more blocks
        than this one (`wanted`, this one included) and the blocks below it were released with it, the
        lowest of those that the table will take anyway (`_run_start`). A cached block taken leaves the
        cache, so none does while free ones remain.

        NOTE: the block after a table's last one first, because CPU attention reads a table's blocks in
        order and scattered ones cost it 1.22-1.27x (`_continues_run`). The free heap holds only blocks no
        table has held (`free` says why), so the lowest free id starts the pool's untouched rest."""
        nxt = None if after is None else after + 1
        if nxt is not None and nxt in self._free_set:
            block = nxt
            self._free_set.remove(block)
        elif self._free_set:
            block = self._pop_free()
        elif nxt is not None and self._continues_run(nxt):
            block = nxt
            self._reuse(block)
        elif self._released:
            block = self._run_start(next(iter(self._released)), wanted)
            self._reuse(block)
        else:
            raise MemoryError("no free KV block")
        self._refs[block] = 1
        return block

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
        if block in self._hash_of:
            self._forget(block)
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
            if block not in self._hash_of:
                raise ValueError(f"KV block {block} is not cached: it cannot be shared")
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
            if self._refs[block] == 0:
                self._clock += 1
                self._released[block] = self._clock
                self._num_uncached_released += block not in self._hash_of
        block_ids.clear()

    # ---- the prefix cache's index ---------------------------------------------------------------

    def lookup(self, block_hash: bytes, next_tokens: tuple[int, ...]) -> tuple[int, CachedKV] | None:
        """A cached block holding these tokens: the one whose lookahead is `next_tokens` if there is one
        (it may continue a match), else the one with the most MTP depths (it may only end one)."""
        candidates = self._blocks_of.get(block_hash)
        if not candidates:
            return None
        best = max(candidates.items(), key=lambda item: (item[1].lookahead == next_tokens, item[1].mtp_depths))
        return best

    def register(self, block: int, block_hash: bytes, kv: CachedKV) -> bool:
        """Index a held, full block by its hash; True if a match can now find it.

        A block with the same hash and lookahead stays the indexed one unless this one ran more MTP
        depths; a lookahead of drafts (None) is indexed only while no other block has the hash."""
        if self._refs[block] <= 0:
            raise ValueError(f"KV block {block} is not held: it cannot be cached")
        if block in self._hash_of:
            return self._hash_of[block] == block_hash
        candidates = self._blocks_of.setdefault(block_hash, {})
        for other, other_kv in list(candidates.items()):
            same = other_kv.lookahead == kv.lookahead or other_kv.lookahead is None or kv.lookahead is None
            if not same:
                continue
            if not kv.better_than(other_kv):
                return False
            self._uncache(other)
        self._blocks_of.setdefault(block_hash, {})[block] = kv
        self._hash_of[block] = block_hash
        return True

    def reset_prefix_cache(self) -> int:
        """Forget every cached block: released ones become free (cached or not), held ones stay with their
        tables but are matched no more. Returns how many were forgotten."""
        forgotten = list(self._hash_of)
        for block in forgotten:
            self._uncache(block)
        for block in self._released:
            self._push_free(block)
        self._released.clear()
        self._num_uncached_released = 0
        return len(forgotten)

    def _uncache(self, block: int) -> None:
        """A block the index forgets; a released one keeps its place in the release order."""
        self._forget(block)
        self._num_uncached_released += block in self._released

    def _forget(self, block: int) -> None:
        block_hash = self._hash_of.pop(block)
        candidates = self._blocks_of[block_hash]
        del candidates[block]
        if not candidates:
            del self._blocks_of[block_hash]

    def check(self) -> None:
        """Raise AssertionError unless the accounting is consistent (tests)."""
        free = self._free_set
        assert free <= set(self._free), "a free block is missing from the free heap"
        for block in range(self.num_blocks):
            in_free, released = block in free, block in self._released
            assert in_free + released + (self._refs[block] > 0) == 1, f"block {block} is in two states"
            assert not (in_free and block in self._hash_of), f"free block {block} is still cached"
        uncached = sum(block not in self._hash_of for block in self._released)
        assert uncached == self._num_uncached_released, "uncached released count out of step"
        assert all(b in self._blocks_of[h] for b, h in self._hash_of.items()), "hash index out of step"
        assert sum(map(len, self._blocks_of.values())) == len(self._hash_of), "hash index sizes differ"
