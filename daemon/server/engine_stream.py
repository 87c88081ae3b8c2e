"""One HTTP request's generation, as one async iterator: the only way a route talks to the engine.

    async with engine.open(request) as stream:   # 1. register the choices, send AddRequests (429/503)
        async for updates in stream:             # 2. ChoiceUpdate batches until every choice finished;
            ...                                  #    a stop-string hit aborts that engine request
    # 3. on exit, however it happens (done, error, client gone): abort what the engine may still run
    #    and free KV a prefill engine may hold for choices nobody will continue
"""

from __future__ import annotations

import asyncio
from types import TracebackType
from typing import TYPE_CHECKING

from mtpserve.server.choice import ChoiceState, ChoiceUpdate
from mtpserve.server.tracker import HeldKV, RequestStream
from mtpserve.web.errors import ApiError

if TYPE_CHECKING:
    from mtpserve.server.engine_client import EngineClient, GenerateRequest


class EngineStream:
    def __init__(self, engine: EngineClient, request: GenerateRequest) -> None:
        self._engine, self._request = engine, request
        self._stream: RequestStream | None = None

    @property
    def requests(self) -> RequestStream:
        """The tracker's stream: choices, prompts, counters (usage)."""
        if self._stream is None:
            raise RuntimeError("EngineStream used outside `async with`")
        return self._stream

    @property
    def choices(self) -> list[ChoiceState]:
        return self.requests.choices

    @property
    def prompts(self) -> list[list[int]]:
        return self.requests.prompts

    async def __aenter__(self) -> EngineStream:
        self._stream = self._engine.submit(self._request)
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        if self._stream is not None:
            self._engine.release(self._stream)

    def __aiter__(self) -> EngineStream:
        return self

    async def __anext__(self) -> list[ChoiceUpdate]:
        if self.requests.finished:
            raise StopAsyncIteration
        return await self._engine.next_updates(self.requests)

    async def wait_held(self, engine_id: int, timeout_s: float) -> HeldKV:
        """PD prefill: wait for the engine's KVHeld of a finished choice, then hand its KV off (the
        stream no longer frees it on exit: the decode instance reads it, the router releases it)."""
        stream = self.requests
        try:
            async with asyncio.timeout(timeout_s):
                while engine_id not in stream.held:
                    await self._engine.next_updates(stream)
        except TimeoutError:
            raise ApiError(500, "The engine did not report the prefilled KV blocks.", code="engine_error") from None
        stream.handed_off.add(engine_id)
        return stream.held[engine_id]
