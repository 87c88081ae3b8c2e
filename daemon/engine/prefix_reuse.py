"""The scheduler's side of the prefix cache: what an admitted request reuses, what a finished step offers,
and the counts /metrics reports.

Pure host state over the block manager's index; the policy itself (hashes, matching, what may be cached)
is prefix_cache.py's.
"""

from __future__ import annotations

from mtpserve.engine import prefix_cache
from mtpserve.engine.block_manager import BlockManager
from mtpserve.engine.prefix_cache import NO_HIT, PrefixHit
from mtpserve.engine.request import Request, RequestId


class PrefixReuse:
    def __init__(self, enabled: bool, blocks: BlockManager, block_size: int, num_speculative_tokens: int,
                 salt: bytes) -> None:
        self.enabled = enabled
        self._blocks, self._block_size, self._k, self._salt = blocks, block_size, num_speculative_tokens, salt
        self.queries = 0  # prefill tokens looked up at admission (vLLM's count)
        self.hits = 0  # of those, tokens whose KV was reused
        self._first_hits: list[tuple[RequestId, int]] = []  # first admissions with a hit, not yet taken

    def applies(self, request: Request) -> bool:
        return self.enabled and request.caches_prefix

    def find(self, request: Request) -> PrefixHit:
        """The longest cached prefix a request about to be admitted can start from."""
        if not self.applies(request) or request.block_ids:
            return NO_HIT
        hashes = prefix_cache.chain_hashes(request.prefill_ids, self._block_size, self._salt,
                                           request.block_hashes)
        return prefix_cache.find(self._blocks, hashes, request.prefill_ids, self._k, request.mtp_key_start)

    def reuse(self, request: Request, hit: PrefixHit, block_copies: list[tuple[int, int]]) -> None:
        """Start an admitted request's table with its hit (its first admission reports it). A hit that
        recomputes part of a block appends (source, copy) to `block_copies`."""
        if self.applies(request):
            self.queries += request.num_prefill_tokens
            self.hits += hit.num_computed
            if request.num_cached_tokens is None:
                request.num_cached_tokens = hit.num_computed
                if hit.num_computed:
                    self._first_hits.append((request.request_id, hit.num_computed))
        if hit is NO_HIT:
            return
        self._blocks.share(list(hit.shared))
        request.block_ids = list(hit.shared)
        if hit.copy_from is not None:
            # NOTE: the source may be evicted by a later take in this same plan; the copy still reads
            # its content, since copies run before the step's forward pass writes anything
            copy = self._blocks.take(after=request.block_ids[-1] if request.block_ids else None)
            request.block_ids.append(copy)
            block_copies.append((hit.copy_from, copy))
        request.num_blocks_cached = hit.num_shared
        request.num_kv_tokens = request.num_prefill_scheduled = hit.num_computed
        request.mtp_depth = min(request.mtp_depth, hit.mtp_depths)

    def offer(self, request: Request) -> None:
        """Offer the full blocks a finished step wrote to the prefix cache, in order."""
        if not self.applies(request):
            return
        bs, k = self._block_size, self._k
        num_full = min(request.num_kv_tokens // bs, len(request.block_ids))
        while request.num_blocks_cached < num_full:
            j = request.num_blocks_cached
            if prefix_cache.beyond_cache(j, bs, request.num_prefill_tokens, k):
                request.num_blocks_cached = len(request.block_ids) + (1 << 30)
                return
            end = (j + 1) * bs
            # NOTE: the block and its lookahead, not the whole sequence: at 64 streams a block fills every
            # few steps per row, and rebuilding each request's sequence for it was half of what the cache
            # added to the host's work per step (181 us of 920 on random prompts, now 90)
            kv = prefix_cache.cached_kv(j, bs, request.num_prefill_tokens, request.tokens(end, end + k), k,
                                        request.mtp_depth, request.mtp_key_start)
            if kv is None:
                return
            known = request.block_hashes
            if len(known) <= j:
                prefix_cache.extend_hashes(known, self._salt, request.tokens(len(known) * bs, end), bs)
            self._blocks.register(request.block_ids[j], known[j], kv)
            request.num_blocks_cached += 1

    def take_first_hits(self) -> list[tuple[RequestId, int]]:
        """(request id, tokens reused) of first admissions that hit, since the last call."""
        hits, self._first_hits = self._first_hits, []
        return hits

    def clear_counts(self) -> None:
        self.queries = self.hits = 0
        self._first_hits = []
