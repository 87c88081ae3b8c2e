"""Per-request streams: the output reader dispatches engine deltas in, route handlers pull updates out.

One `RequestStream` per HTTP request holds its choices (n fan-out, several prompts): every choice
is its own engine request, and all of them feed the stream's one queue, so a handler waits on a
single queue whatever n is.
"""

from __future__ import annotations

import asyncio
import time
from typing import NamedTuple

from mtpserve.ipc.request_channel import KVHeld, PrefixHits
from mtpserve.server.choice import ChoiceState, ChoiceUpdate, Timed
from mtpserve.web.errors import ApiError
from mtpserve.server.outputs import TokenDelta


class HeldKV(NamedTuple):
    """PD prefill: the engine's KVHeld and when it arrived (the lease runs from then)."""

    arrived: float  # time.monotonic()
    msg: KVHeld


class RequestStream:
    def __init__(self, choices: list[ChoiceState], prompts: list[list[int]]) -> None:
        self.choices = choices
        self.by_engine_id = {c.engine_id: c for c in choices}
        self.prompts = prompts  # [num_prompts][prompt_len] token ids as sent to the engine
        self.num_prompt_tokens = [len(p) for p in prompts]  # [num_prompts]
        self.held: dict[int, HeldKV] = {}  # engine id -> KV the prefill engine holds for it
        self.handed_off: set[int] = set()  # engine ids whose kv_transfer_params were answered
        self._queue: asyncio.Queue[Timed | HeldKV | ApiError] = asyncio.Queue()

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.choices)

    def put(self, item: Timed | HeldKV | ApiError) -> None:
        self._queue.put_nowait(item)

    async def next_updates(self) -> list[ChoiceUpdate]:
        """Wait for at least one delta, then take everything queued; a failure raises its ApiError."""
        items = [await self._queue.get()]
        while not self._queue.empty():
            items.append(self._queue.get_nowait())
        return self._apply(items)

    def _apply(self, items: list[Timed | HeldKV | ApiError]) -> list[ChoiceUpdate]:
        grouped: dict[int, list[Timed]] = {}
        for item in items:
            if isinstance(item, ApiError):
                raise item
            if isinstance(item, HeldKV):
                self.held[item.msg.request_id] = item
            else:
                grouped.setdefault(item.delta.request_id, []).append(item)
        updates = [self.by_engine_id[rid].apply(group) for rid, group in grouped.items()]
        return sorted((u for u in updates if u is not None), key=lambda u: u.index)

    def num_steps(self) -> int:
        return sum(c.num_steps for c in self.choices)


class Tracker:
    """engine request id -> stream. Deltas for unknown ids (already released) are dropped."""

    def __init__(self) -> None:
        self._streams: dict[int, RequestStream] = {}

    @property
    def num_active(self) -> int:
        return len(self._streams)

    def register(self, stream: RequestStream) -> None:
        for engine_id in stream.by_engine_id:
            self._streams[engine_id] = stream

    def unregister(self, stream: RequestStream) -> None:
        for engine_id in stream.by_engine_id:
            self._streams.pop(engine_id, None)

    def dispatch(self, batch: list[TokenDelta]) -> None:
        now = time.monotonic()
        for delta in batch:  # NOTE: one entry per request per step, never per token
            stream = self._streams.get(delta.request_id)
            if stream is not None:
                stream.put(Timed(now, delta))

    def kv_held(self, msg: KVHeld) -> bool:
        """Hand a KVHeld to its stream; False when no stream waits for it (released meanwhile)."""
        stream = self._streams.get(msg.request_id)
        if stream is not None:
            stream.put(HeldKV(time.monotonic(), msg))
        return stream is not None

    def prefix_hits(self, msg: PrefixHits) -> None:
        """Record each choice's cached prompt tokens; the engine sends them before the choice's first
        frame, and usage reads them at the end (ids already released are ignored)."""
        for engine_id, num_tokens in zip(msg.request_ids, msg.cached_tokens):
            stream = self._streams.get(engine_id)
            if stream is not None:
                stream.by_engine_id[engine_id].num_cached_tokens = num_tokens

    def fail(self, engine_id: int, error: ApiError) -> None:
        stream = self._streams.get(engine_id)
        if stream is not None:
            stream.put(error)

    def fail_all(self, error: ApiError) -> None:
        for stream in set(self._streams.values()):
            stream.put(error)
