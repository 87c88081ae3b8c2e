"""The decode role's connector: a request that another instance prefilled waits here until its prompt
KV has been read into local blocks, then enters the scheduler as if it had prefilled here.

1. `on_add`: a request with `remote` queues for blocks (FCFS); the others are ordinary requests.
2. `before_step`: reads that outlived their source's lease are abandoned (the request recomputes its
   prompt in other blocks; the reserved ones stay out of use until the read returns, since it may
   still write into them); then queued requests get blocks and their reads start. A request whose
   source lease ends within `margin_s` recomputes instead of reading.
3. `fetched` (on the loop thread, when a read returns): the request enters the scheduler, decoding
   from its first token (read) or recomputing its prompt (read failed).
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable

from mtpserve import log
from mtpserve.engine.kv_connector import KVConnector, KVEndpoint, KVStats, RequestId
from mtpserve.engine.request import FinishReason, Request


@dataclasses.dataclass(frozen=True)
class KVFetch:
    """Read a prefilled prompt's KV from `source` into the local `block_ids`."""

    request_id: RequestId
    block_ids: tuple[int, ...]
    source: object  # RemoteKV.source: what the transfer layer needs to find the remote blocks


class DecodeConnector(KVConnector):
    role = "decode"

    def __init__(self, start_read: Callable[[KVFetch], None], margin_s: float = 1.0,
                 endpoint: KVEndpoint | None = None) -> None:
        """`start_read` begins a read without waiting; its end comes back through `fetched`."""
        self.start_read, self.margin_s, self.endpoint = start_read, margin_s, endpoint
        self.queue: collections.deque[Request] = collections.deque()  # waiting for blocks
        self.fetching: dict[RequestId, Request] = {}  # blocks reserved, read in flight
        self.abandoned: dict[RequestId, list[int]] = {}  # blocks of reads given up on
        self.num_fallbacks = 0  # prefilled prompts recomputed here instead
        self.num_fetches = 0
        self.fetch_bytes = 0
        self.fetch_seconds = 0.0
        self.logger = log.get_logger("mtpserve.pd")

    @property
    def num_pending(self) -> int:
        return len(self.queue) + sum(not r.is_finished for r in self.fetching.values())

    def on_add(self, request: Request) -> bool:
        if request.remote is None:
            return False
        if request.request_id in self.fetching or any(r.request_id == request.request_id for r in self.queue):
            raise ValueError(f"duplicate request id {request.request_id}")
        self.queue.append(request)
        return True

    def on_abort(self, request_id: RequestId) -> Request | None:
        request = self.fetching.get(request_id)  # NOTE: its blocks are freed when the read returns
        if request is None:
            request = next((r for r in self.queue if r.request_id == request_id), None)
            if request is None:
                return None
            self.queue.remove(request)
        if request.is_finished:
            return None
        request.finish(FinishReason.ABORT)
        return request

    def before_step(self) -> None:
        self.abandon_stale(time.time())
        self.start_fetches(time.time())

    def abandon_stale(self, now: float) -> list[RequestId]:
        """Give up on reads still running after their source's lease ended (the prefill stopped
        answering): those requests recompute their prompt here instead of waiting for the read."""
        stale = [rid for rid, r in self.fetching.items() if r.remote is not None and now > r.remote.deadline]
        for request_id in stale:
            request = self.fetching.pop(request_id)
            self.abandoned[request_id] = request.block_ids
            request.block_ids = []
            if not request.is_finished:
                self._recompute(request)
        if stale:
            self.logger.warning("kv read outlived the prefill's lease, recomputing", request_ids=stale)
        return stale

    def start_fetches(self, now: float) -> list[KVFetch]:
        """Reserve blocks for queued requests (FCFS) and start their reads."""
        started = []
        blocks = self.scheduler.blocks
        while self.queue:
            request = self.queue[0]
            if request.remote is None or now > request.remote.deadline - self.margin_s:
                self.queue.popleft()
                self._recompute(request)
                continue
            num_prompt = int(request.prompt_ids.shape[0])
            if not blocks.can_grow([], num_prompt):
                break
            self.queue.popleft()
            # NOTE: room for the outputs after the prompt's run, as the scheduler claims it (block_manager.py)
            expected = num_prompt + request.params.max_tokens + self.scheduler.config.decode_window
            blocks.grow(request.block_ids, num_prompt, expected_tokens=expected)
            self.fetching[request.request_id] = request
            started.append(KVFetch(request.request_id, tuple(request.block_ids), request.remote.source))
        for fetch in started:
            self.start_read(fetch)
        return started

    def fetched(self, request_id: RequestId, ok: bool, nbytes: int = 0, seconds: float = 0.0) -> None:
        """A read finished (`ok`) or failed; on failure the prompt is recomputed."""
        if request_id in self.abandoned:
            self.scheduler.blocks.free(self.abandoned.pop(request_id))
            return
        request = self.fetching.pop(request_id)
        if ok:
            self.num_fetches += 1
            self.fetch_bytes += nbytes
            self.fetch_seconds += seconds
        if request.is_finished:
            self.scheduler.blocks.free(request.block_ids)
        elif ok:
            request.kv_arrived()
            self.scheduler.add(request)
        else:
            self._recompute(request)

    def _recompute(self, request: Request) -> None:
        self.scheduler.blocks.free(request.block_ids)
        request.block_ids = []
        request.kv_lost()
        self.num_fallbacks += 1
        self.scheduler.add(request)

    def stats(self) -> KVStats:
        return KVStats(num_kv_fetches=self.num_fetches, kv_fetch_bytes=self.fetch_bytes,
                    kv_fetch_seconds=self.fetch_seconds, num_kv_fallbacks=self.num_fallbacks)
