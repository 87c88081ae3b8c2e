"""The prefix cache's index of KV blocks: which block holds the KV of which hashed token prefix.

The block pool (block_pool.py) holds the blocks' states and this index of which of them are cached; the
prefix cache's policy (prefix_cache.py) says what a block's hash and `CachedKV` are. Several blocks may share a
hash, one per lookahead: the same prefix, continued differently.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class CachedKV:
    """What a cached block's content depends on beyond the tokens its hash covers
    (docs/prefix-caching.md).

    `lookahead`: the tokens past the block's end that its MTP KV read (MTP depth i at position t reads
    the token at t+i+1), k of them; None when some were drafts. A block is reused inside a match only
    when the new request has these same tokens there; otherwise it may end a match, whose last k
    positions are recomputed anyway.
    `mtp_depths`: the MTP depths that ran over it (fewer under adaptive speculation: deeper depths left
    gaps, which a request that matches it inherits as if it had run those steps itself); NO_MTP_KV (-1)
    where it lay before its request's key start and no depth ran over it (prefix_cache.find).
    """

    lookahead: tuple[int, ...] | None
    mtp_depths: int

    def better_than(self, other: CachedKV) -> bool:
        """Of two blocks with the same tokens that a match could use in the same places."""
        return (self.lookahead is not None, self.mtp_depths) > (other.lookahead is not None, other.mtp_depths)


class BlockIndex:
    """Cached blocks by hash and hashes by block; what a block's state is (held, released, claimed) is the
    pool's (block_pool.py)."""

    def __init__(self) -> None:
        self._hash_of: dict[int, bytes] = {}
        self._blocks_of: dict[bytes, dict[int, CachedKV]] = {}

    def __contains__(self, block: int) -> bool:
        return block in self._hash_of

    def __len__(self) -> int:
        return len(self._hash_of)

    def blocks(self) -> list[int]:
        return list(self._hash_of)

    def hash_of(self, block: int) -> bytes:
        return self._hash_of[block]

    def lookup(self, block_hash: bytes, next_tokens: tuple[int, ...]) -> tuple[int, CachedKV] | None:
        """A block holding these tokens: the one whose lookahead is `next_tokens` if there is one (it may
        continue a match), else the one with the most MTP depths (it may only end one)."""
        candidates = self._blocks_of.get(block_hash)
        if not candidates:
            return None
        return max(candidates.items(), key=lambda item: (item[1].lookahead == next_tokens, item[1].mtp_depths))

    def displaced(self, block_hash: bytes, kv: CachedKV) -> list[int] | None:
        """The indexed blocks a new block with this hash and `kv` would replace; None if it should not be
        indexed. A block with the same lookahead stays unless the new one ran more MTP depths; a lookahead of
        drafts (None) is indexed only while no other block has the hash."""
        replaced = []
        for other, other_kv in self._blocks_of.get(block_hash, {}).items():
            same = other_kv.lookahead == kv.lookahead or other_kv.lookahead is None or kv.lookahead is None
            if not same:
                continue
            if not kv.better_than(other_kv):
                return None
            replaced.append(other)
        return replaced

    def add(self, block: int, block_hash: bytes, kv: CachedKV) -> None:
        self._blocks_of.setdefault(block_hash, {})[block] = kv
        self._hash_of[block] = block_hash

    def remove(self, block: int) -> None:
        block_hash = self._hash_of.pop(block)
        candidates = self._blocks_of[block_hash]
        del candidates[block]
        if not candidates:
            del self._blocks_of[block_hash]

    def check(self) -> None:
        """Raise AssertionError unless the two maps agree (tests)."""
        assert all(b in self._blocks_of[h] for b, h in self._hash_of.items()), "hash index out of step"
        assert sum(map(len, self._blocks_of.values())) == len(self._hash_of), "hash index sizes differ"
