"""The prefix cache's policy: block hashes, what an admitted request reuses, what a finished step caches.

Pure host functions over the block manager's index (block_manager.py); the scheduler calls them.

  * Hash: block j's hash is BLAKE2b-128 of (block j-1's hash, block j's token ids), chained from a salt
    naming the model and the KV layout, so equal hashes mean equal token prefixes and equal weights.
  * Match (admission): the longest run of cached full blocks, never the prompt's last token (its logits
    are needed), and none without MTP KV past the request's key start (mtp_window.py). MTP depth i's KV at position t read the token at t+i+1, so a block's last k positions
    depend on tokens past it: a block continues a match only when the tokens its MTP KV read past its
    end (`CachedKV.lookahead`) are the new request's, and the match's last k positions are computed
    again, in a private copy of the block that holds them (the main KV there is recomputed too).
  * Cache (after a step): full blocks whose KV a finished step wrote, when that KV is what a miss would
    compute: with k >= 2 only blocks inside the prefilled tokens (a decode window's depth >= 1 keys near
    its frontier read drafts); with k <= 1 decode blocks too.
"""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np

from mtpserve.engine.block_index import CachedKV
from mtpserve.engine.block_manager import BlockManager


def salt(*parts: object) -> bytes:
    """The root of every hash chain: whatever besides the tokens decides the KV (model, dtype)."""
    return hashlib.blake2b(repr(parts).encode(), digest_size=16).digest()


def chain_hashes(tokens: np.ndarray, block_size: int, root: bytes, known: list[bytes]) -> list[bytes]:
    """`known` (hashes of the first blocks, kept) extended to every full block of `tokens` [N] int64.

    NOTE: 128 bits: with a billion blocks ever hashed, a collision has probability ~1e-21."""
    return extend_hashes(known, root, tokens[len(known) * block_size:], block_size)


def extend_hashes(known: list[bytes], root: bytes, tokens: np.ndarray, block_size: int) -> list[bytes]:
    """`known` extended by the full blocks of `tokens` [N] int64, the tokens right after the blocks it covers."""
    parent = known[-1] if known else root
    for j in range(tokens.shape[0] // block_size):
        block = np.ascontiguousarray(tokens[j * block_size:(j + 1) * block_size], np.int64)
        parent = hashlib.blake2b(parent + block.tobytes(), digest_size=16).digest()
        known.append(parent)
    return known


@dataclasses.dataclass(frozen=True)
class PrefixHit:
    """What an admitted request reuses: `shared` blocks as they are, then `copy_from` copied into a block
    of its own (the block holding its first computed position, when that is not a block start); its
    prefill starts at position `num_computed`."""

    shared: tuple[int, ...]
    copy_from: int | None
    num_computed: int
    mtp_depths: int

    @property
    def num_shared(self) -> int:
        return len(self.shared)


NO_HIT = PrefixHit((), None, 0, 1 << 30)
# NOTE: a block before its request's key start (mtp_window.py): no depth ran over it, and unlike a depth left
# unused (a gap, which a miss under the same policy may leave too) a miss past the requester's key start writes it
NO_MTP_KV = -1


def find(blocks: BlockManager, hashes: list[bytes], tokens: np.ndarray, num_mtp: int, key_start: int = 0) -> PrefixHit:
    """The reuse for a request whose prefill tokens are `tokens` [P] with full-block `hashes`, and whose drafts
    read the MTP KV from `key_start` on (the blocks before it count for no depth's gaps)."""
    bs = blocks.block_size
    matched: list[int] = []
    depths = 1 << 30
    for j in range(min(len(hashes), (tokens.shape[0] - 1) // bs)):
        end = (j + 1) * bs
        found = blocks.lookup(hashes[j], tuple(tokens[end:end + num_mtp].tolist()))
        if found is None:
            break
        block, kv = found
        if end > key_start:
            if kv.mtp_depths == NO_MTP_KV:
                break  # NOTE: its MTP KV was never written, where the request's drafts read it: a miss writes it
            depths = min(depths, kv.mtp_depths)
        matched.append(block)
        if kv.lookahead != tuple(tokens[end:end + num_mtp].tolist()):
            break  # NOTE: it may end the match: its last positions are recomputed
    if not matched:
        return NO_HIT
    num_matched = len(matched) * bs
    start = num_matched - min(num_mtp, num_matched)
    first_owned = start // bs
    copy_from = matched[first_owned] if start % bs else None
    return PrefixHit(tuple(matched[:first_owned]), copy_from, start, depths)


def beyond_cache(block_index: int, block_size: int, num_prefilled: int, num_mtp: int) -> bool:
    """True for a request's blocks that are never cached: with k >= 2, those past its prefill (a decode
    window's depth >= 1 keys near its frontier read drafts). `num_prefilled`: the tokens its prefill
    computed (prompt, plus outputs kept across a preemption)."""
    return num_mtp >= 2 and (block_index + 1) * block_size > num_prefilled


def cached_kv(block_index: int, block_size: int, num_prefilled: int, lookahead: np.ndarray,
              num_mtp: int, mtp_depths: int, key_start: int = 0) -> CachedKV | None:
    """The CachedKV of a request's full, written block (not `beyond_cache`); None while the tokens its
    MTP KV read past its end are not all known yet (the next step's). `lookahead`: the request's tokens
    (prompt + outputs) known past the block's end, num_mtp at most; a block before the request's `key_start`
    holds no MTP KV (NO_MTP_KV)."""
    end = (block_index + 1) * block_size
    if end <= key_start:
        mtp_depths = NO_MTP_KV
    if end + num_mtp - 1 > num_prefilled and num_mtp >= 2:
        return CachedKV(None, min(mtp_depths, num_mtp))  # NOTE: a depth >= 1 read the prefill's drafts
    if lookahead.shape[0] < num_mtp:
        return None
    return CachedKV(tuple(lookahead[:num_mtp].tolist()), min(mtp_depths, num_mtp))
