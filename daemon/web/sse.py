"""Server-sent events: `data: <json>\n\n` per chunk, `data: [DONE]\n\n` at the end.

Once the 200 and headers are out, an error can only travel in-band: an event whose body is the
OpenAI error object, followed by `[DONE]`.
"""

from __future__ import annotations

import msgspec
from aiohttp import web

from mtpserve.web.errors import ApiError

_ENCODER = msgspec.json.Encoder()
DONE = b"data: [DONE]\n\n"


def event(obj: object) -> bytes:
    return b"data: " + _ENCODER.encode(obj) + b"\n\n"


class SseWriter:
    def __init__(self, request: web.Request) -> None:
        self._request = request
        self.response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                                    "Cache-Control": "no-cache"})

    @property
    def started(self) -> bool:
        return self.response.prepared

    async def start(self) -> None:
        await self.response.prepare(self._request)

    async def send(self, obj: object) -> None:
        await self.response.write(event(obj))

    async def send_many(self, objs: list[object]) -> None:
        """Several chunks in one write (one syscall when a step produced updates for many choices)."""
        await self.response.write(b"".join(map(event, objs)))

    async def send_error(self, error: ApiError) -> None:
        await self.response.write(event(error.body()))

    async def finish(self) -> web.StreamResponse:
        await self.response.write(DONE)
        await self.response.write_eof()
        return self.response
