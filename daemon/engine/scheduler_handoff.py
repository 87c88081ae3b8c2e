"""The scheduler's part in PD (docs/pd.md): prefilled requests whose KV is read from another instance
(decode role), and blocks held for another instance after a request finished (prefill role).

A mixin of `Scheduler`: it works on the scheduler's block manager, waiting queue and these fields:
  fetch_queue  prefilled requests waiting for blocks to read their KV into (FCFS);
  fetching     request id -> request whose blocks are reserved and whose read is in flight;
  abandoned    request id -> blocks of a read given up on, until the read returns;
  held         request id -> blocks of a finished prefill-role request, until released.
"""

from __future__ import annotations

import bisect
import collections

from mtpserve.engine.block_manager import BlockManager
from mtpserve.engine.request import Request


class KVHandoff:
    blocks: BlockManager
    waiting: collections.deque[Request]
    fetch_queue: collections.deque[Request]
    fetching: dict[int | str, Request]
    abandoned: dict[int | str, list[int]]
    held: dict[int | str, list[int]]
    num_preemptions: int

    def _reclaim_waiting_kv(self) -> bool:
        """Free the blocks of the latest waiting request that holds KV read from a prefill
        instance; it recomputes instead. False if none does."""
        for request in reversed(self.waiting):
            if request.block_ids:
                self.blocks.free(request.block_ids)
                request.preempt()
                self.num_preemptions += 1
                return True
        return False

    def start_fetches(self, now: float, margin_s: float) -> list[Request]:
        """Decode role: reserve blocks for queued prefilled requests (FCFS) and return those whose
        KV should be read now. A request whose source lease ends within `margin_s` of `now`
        recomputes its prompt instead."""
        started = []
        while self.fetch_queue:
            request = self.fetch_queue[0]
            if now > request.remote.deadline - margin_s:
                self.fetch_queue.popleft()
                self._requeue(request, arrived=False)
                continue
            if not self.blocks.can_grow([], request.prompt_ids.shape[0]):
                break
            self.fetch_queue.popleft()
            self.blocks.grow(request.block_ids, int(request.prompt_ids.shape[0]))
            self.fetching[request.request_id] = request
            started.append(request)
        return started

    def abandon_fetch(self, request_id: int | str) -> Request | None:
        """Stop waiting for a read that outlived its source's lease (a prefill that stopped
        answering): the request recomputes its prompt in other blocks, and the reserved ones stay
        out of use until the read returns (it may still write into them). Returns the request."""
        request = self.fetching.pop(request_id)
        self.abandoned[request_id] = request.block_ids
        request.block_ids = []
        if not request.is_finished:
            self._requeue(request, arrived=False)
        return request

    def fetch_done(self, request_id: int | str, ok: bool) -> Request | None:
        """A read finished (`ok`) or failed; returns the request unless it was aborted or
        abandoned meanwhile."""
        if request_id in self.abandoned:
            self.blocks.free(self.abandoned.pop(request_id))
            return None
        request = self.fetching.pop(request_id)
        if request.is_finished:
            self.blocks.free(request.block_ids)
            return None
        self._requeue(request, arrived=ok)
        return request

    def _requeue(self, request: Request, arrived: bool) -> None:
        if arrived:
            request.kv_arrived()
        else:
            self.blocks.free(request.block_ids)
            request.kv_lost()
        keys = [r.arrival for r in self.waiting]
        self.waiting.insert(bisect.bisect(keys, request.arrival), request)

    def release_held(self, request_id: int | str) -> bool:
        """Prefill role: free a finished request's held blocks; False if none are held."""
        block_ids = self.held.pop(request_id, None)
        if block_ids is None:
            return False
        self.blocks.free(block_ids)
        return True
