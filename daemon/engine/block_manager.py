"""Paged KV block accounting: reference-counted fixed-size blocks, kept in runs, some of them cached.

The states a block goes through are block_pool.py's, runs and their claims block_claims.py's, and the prefix
cache's index of blocks by hash block_index.py's. Here is what a table asks for and gives back:
  * taking: a growing table takes the block right after its last one when it claimed it, or it is free,
    or released and uncached, or cached and among the older half of the released ones
    (`BlockPool.continues_run`); a table that will take more starts a run where one is takable; else the
    lowest free id, else the least recently released block (evicting it if cached), or, for a table that
    takes several of a run released together, the lowest of them (`BlockPool.run_start`); else a claimed
    one;
  * releasing: a table's blocks go to the release order last first, and its claim ends.
Only full blocks whose KV a finished step wrote are cached (`register`), and a request writes only into
blocks it alone holds, so a cached block's content never changes while it is indexed.
"""

from __future__ import annotations

from mtpserve.engine.block_claims import Claims
from mtpserve.engine.block_index import CachedKV
from mtpserve.engine.block_pool import BlockPool


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


# NOTE: growth room a new run claims beyond the blocks it takes now (`grow(expected_tokens=...)`): at 64 streams a
# table of a 256-token prompt grows by two blocks, and a claim per table as long as max_tokens allows could hold
# most of a pool
MAX_CLAIM_BLOCKS = 8


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
        self._pool = BlockPool(num_blocks)
        self._claims = Claims(self._pool)
        self._index = self._pool.index  # NOTE: the prefix cache's: which blocks are cached, by hash

    # ---- counts ---------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks a request can take: free, plus released ones (a cached one is evicted on demand)."""
        return self._pool.num_free

    @property
    def num_claimed_blocks(self) -> int:
        """Free or released blocks a table's run keeps for it to grow into."""
        return len(self._pool.claimed)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._index)

    @property
    def num_evictable_blocks(self) -> int:
        """Cached blocks no table holds."""
        return self._pool.num_evictable

    def refs(self, block: int) -> int:
        return self._pool.refs[block]

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
        one included), the start of a new run (`Claims.find_run`); else the lowest free one; else the least
        recently released one, or, when the table wants more blocks than this one (`wanted`, this one
        included) and the blocks below it were released with it, the lowest of those that the table will
        take anyway (`BlockPool.run_start`); else one another table claimed. A block that continues or starts
        a run claims the blocks after it, up to `room` (`Claims.start_run`). A cached block taken leaves the
        cache, so none does while free ones remain, but for a run's sake (`BlockPool.takable`).

        NOTE: the block after a table's last one first, because CPU attention reads a table's blocks in
        order and scattered ones cost it 1.22-1.27x (`BlockPool.continues_run`). The free heap holds only
        blocks no table has held (`free` says why), so the lowest free id starts the pool's untouched rest."""
        pool, claims = self._pool, self._claims
        nxt = None if after is None else after + 1
        if after is not None and after in claims and claims.take_claimed(after):
            block = after + 1  # NOTE: the claim moved on to it
        elif nxt is not None and (nxt in pool.free_set or self._continues_cheaply(nxt)):
            block = claims.start_run(room, nxt)
        elif room > 1 and (pool.free_set or pool.released):
            block = claims.start_run(room)
        elif pool.free_set:
            block = pool.pop_free()
        elif pool.released:
            block = pool.run_start(next(iter(pool.released)), wanted)
            pool.reuse(block)
        elif pool.claimed:
            block = next(iter(pool.claimed))
            pool.unclaim(block)  # NOTE: its claim now ends there (`Claims.take_claimed`)
            pool.reuse(block)
        else:
            raise MemoryError("no free KV block")
        pool.refs[block] = 1
        return block

    def _continues_cheaply(self, block: int) -> bool:
        """Whether a table whose last block is right before this one takes it before any free one: it is
        released and uncached (taking it evicts nothing), or no block is free and it is old
        (`BlockPool.continues_run`)."""
        pool = self._pool
        if block not in pool.released:
            return False
        return block not in self._index or not pool.free_set and pool.continues_run(block)

    def share(self, block_ids: list[int]) -> None:
        """Another table holds these cached blocks (a prefix hit)."""
        for block in block_ids:
            if block not in self._index:
                raise ValueError(f"KV block {block} is not cached: it cannot be shared")
            self._pool.share(block)

    def free(self, block_ids: list[int]) -> None:
        """Release a table's blocks (and empty it). A cached block no table holds any more stays
        cached until evicted.

        NOTE: released last block first, so that under pressure a sequence's tail is evicted before
        its head: the head is the part other prompts share. Uncached blocks take their place in the
        order too: on the free heap, a K=3 instance's decode blocks (never cached) came back as single
        ids that split every table that took them, and at 64 streams on code only 33% of the running
        tables' neighbouring blocks were consecutive, against 58% at k=0, whose every full block is cached;
        its decode steps' forward pass took 3% longer (docs/architecture.md, Runs of blocks)."""
        refs = self._pool.refs
        for block in reversed(block_ids):
            if refs[block] <= 0:
                raise ValueError(f"double free of KV block {block}")
            refs[block] -= 1
            if refs[block] == 0:
                self._claims.end(block)
                self._pool.release(block)
        block_ids.clear()

    # ---- the prefix cache's index ---------------------------------------------------------------

    def lookup(self, block_hash: bytes, next_tokens: tuple[int, ...]) -> tuple[int, CachedKV] | None:
        """A cached block holding these tokens (`BlockIndex.lookup`)."""
        return self._index.lookup(block_hash, next_tokens)

    def register(self, block: int, block_hash: bytes, kv: CachedKV) -> bool:
        """Index a held, full block by its hash; True if a match can now find it (the blocks it replaces,
        `BlockIndex.displaced`, leave the cache)."""
        if self._pool.refs[block] <= 0:
            raise ValueError(f"KV block {block} is not held: it cannot be cached")
        if block in self._index:
            return self._index.hash_of(block) == block_hash
        displaced = self._index.displaced(block_hash, kv)
        if displaced is None:
            return False
        for other in displaced:
            self._pool.uncache(other)
        self._index.add(block, block_hash, kv)
        return True

    def reset_prefix_cache(self) -> int:
        """Forget every cached block: released ones become free (cached or not), held ones stay with their
        tables but are matched no more. Returns how many were forgotten."""
        return self._pool.forget_cache()

    def check(self) -> None:
        """Raise AssertionError unless the accounting is consistent (tests)."""
        self._pool.check()
        self._claims.check()
