"""A backend's SSE body as batches of whole events (`data: <json>\\n\\n`), one batch per network read.

Relaying batches, not single events, keeps the router at one client write per backend write (the
instance sends several choices' chunks in one write).
"""

from __future__ import annotations

import aiohttp
import msgspec

from mtpserve.router.backends import Backend
from mtpserve.router.failures import backend_errors

DONE = b"data: [DONE]\n\n"
_SEP = b"\n\n"
_KV_KEY = b'"kv_transfer_params"'
_ERROR_HEAD = b'data: {"error"'


class SseReader:
    def __init__(self, response: aiohttp.ClientResponse, backend: Backend) -> None:
        self._response = response
        self._backend = backend
        self._pending = b""  # a partial event carried to the next read

    async def next_batch(self) -> list[bytes] | None:
        """The next whole events, each with its trailing blank line; None at the end of the body.

        Raises BackendFailure on a reset, a timeout (the session's idle read timeout) or a body cut
        inside the chunked encoding."""
        while True:
            with backend_errors(self._backend):
                data = await self._response.content.readany()
            if not data:
                return self._rest()
            self._pending += data
            cut = self._pending.rfind(_SEP)
            if cut >= 0:
                whole, self._pending = self._pending[:cut], self._pending[cut + len(_SEP):]
                return [event + _SEP for event in whole.split(_SEP) if event]

    def _rest(self) -> list[bytes] | None:
        """At the end of the body: an event the backend did not close with a blank line, if any."""
        rest, self._pending = self._pending.strip(), b""
        return [rest + _SEP] if rest else None


def kv_transfer_params(event: bytes) -> dict | None:
    """The prefill's `{"kv_transfer_params": {...}}` event's params; None for any other event."""
    if _KV_KEY not in event:
        return None
    try:
        body = msgspec.json.decode(event.removeprefix(b"data: ").rstrip())
    except msgspec.DecodeError:
        return None
    params = body.get("kv_transfer_params") if isinstance(body, dict) else None
    return params if isinstance(params, dict) else None


def is_error(event: bytes) -> bool:
    return event.startswith(_ERROR_HEAD)
