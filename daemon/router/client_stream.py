"""The SSE response to the client: started once the prefill answered 200, relayed to in raw batches.

Errors after the start travel in-band in the instance's shape (mtpserve.web.sse): an event whose
body is the OpenAI error object, then `[DONE]`.
"""

from __future__ import annotations

import contextlib
import time

from aiohttp import web

from mtpserve.router.metrics import RouterMetrics
from mtpserve.web.sse import DONE, event


class ClientStream:
    def __init__(self, request: web.Request, metrics: RouterMetrics) -> None:
        self._request = request
        self._metrics = metrics
        self._arrival = time.monotonic()
        self._written = False
        self.response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                                    "Cache-Control": "no-cache"})

    @property
    def started(self) -> bool:
        return self.response.prepared

    async def start(self, request_id: str | None) -> None:
        if request_id:
            self.response.headers["X-Request-Id"] = request_id
        await self.response.prepare(self._request)

    async def write(self, raw: bytes) -> None:
        """Raw events; the first write is the router's time to first token."""
        if not self._written:
            self._written = True
            self._metrics.ttft.observe(time.monotonic() - self._arrival)
        await self.response.write(raw)

    async def finish(self, send_done: bool) -> web.StreamResponse:
        await self.response.write(DONE if send_done else b"")
        await self.response.write_eof()
        return self.response

    async def fail(self, error_body: dict) -> web.StreamResponse:
        """Error event, [DONE], end; a client that already left is not an error here."""
        with contextlib.suppress(ConnectionError):
            await self.response.write(event(error_body) + DONE)
            await self.response.write_eof()
        return self.response
