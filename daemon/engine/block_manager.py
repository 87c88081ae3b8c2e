"""Paged KV block accounting: a free list of fixed-size blocks, handed out per request."""

from __future__ import annotations

import heapq


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockManager:
    """Owns the ids `0 .. num_blocks-1`; a block is either free or in exactly one block table.

    NOTE: pure host accounting. The device reads block tables that the engine copies with each step,
    so freeing here while a launched step still writes the old owner's KV is safe: the device runs
    steps in launch order, and any new owner's writes come in a later step.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # NOTE: a min-heap, lowest id first, so a request's blocks tend to be consecutive: a PD KV read
        # is one copy per run of consecutive blocks, and each copy costs ~60 us over TCP.
        self._free: list[int] = list(range(num_blocks))
        self._is_used = [False] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def num_missing(self, block_ids: list[int], num_tokens: int) -> int:
        """How many more blocks a table needs to hold `num_tokens` token slots."""
        return max(0, blocks_for(num_tokens, self.block_size) - len(block_ids))

    def can_grow(self, block_ids: list[int], num_tokens: int) -> bool:
        return self.num_missing(block_ids, num_tokens) <= len(self._free)

    def grow(self, block_ids: list[int], num_tokens: int) -> list[int]:
        """Append blocks to `block_ids` (in place) to cover `num_tokens`; returns the new ones."""
        missing = self.num_missing(block_ids, num_tokens)
        if missing > len(self._free):
            raise MemoryError(f"need {missing} KV blocks, {len(self._free)} free")
        new = [self._take() for _ in range(missing)]
        block_ids.extend(new)
        return new

    def free(self, block_ids: list[int]) -> None:
        for block in block_ids:
            if not self._is_used[block]:
                raise ValueError(f"double free of KV block {block}")
            self._is_used[block] = False
            heapq.heappush(self._free, block)
        block_ids.clear()

    def _take(self) -> int:
        block = heapq.heappop(self._free)
        self._is_used[block] = True
        return block
