"""What can go wrong with a backend call, in two kinds.

`BackendRejected`: the backend answered 4xx; before the client's stream starts it is passed through
(status and body), after it the body's error object becomes the SSE error event.
`BackendFailure`: no usable answer (connection refused or reset, timeout, 5xx, a malformed body);
the client gets 502, or 503 when the backend could not be reached or said 503 itself.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

import aiohttp
import msgspec

from mtpserve.router.backends import Backend
from mtpserve.web.errors import ApiError

MAX_ERROR_TEXT = 500  # characters of a backend's error body quoted in our message


class BackendFailure(Exception):
    def __init__(self, backend: Backend, kind: str, detail: str, status: int = 502) -> None:
        super().__init__(f"{backend.role} instance {backend.url}: {detail}")
        self.backend, self.kind, self.status = backend, kind, status

    def api_error(self) -> ApiError:
        return ApiError(self.status, str(self), code=f"backend_{self.kind}")


class BackendRejected(Exception):
    def __init__(self, backend: Backend, status: int, body: bytes, content_type: str) -> None:
        super().__init__(f"{backend.role} instance {backend.url} answered {status}")
        self.backend, self.status, self.body, self.content_type = backend, status, body, content_type

    def error_body(self) -> dict:
        """The backend's OpenAI error object when it sent one, else one describing the answer."""
        with contextlib.suppress(msgspec.DecodeError):
            body = msgspec.json.decode(self.body)
            if isinstance(body, dict) and isinstance(body.get("error"), dict):
                return body
        return ApiError(self.status, f"{self}: {_text(self.body)}").body()


@contextlib.contextmanager
def backend_errors(backend: Backend) -> Iterator[None]:
    """Turn aiohttp's client exceptions raised while talking to `backend` into a BackendFailure.

    NOTE: wrap backend reads only; a write to our own client that fails raises aiohttp's
    ClientConnectionResetError, which is a client disconnect, not a backend failure.
    """
    try:
        yield
    except aiohttp.ClientConnectorError as exc:
        backend.mark_unhealthy(f"connect failed: {exc.os_error}")
        raise BackendFailure(backend, "unreachable", f"cannot connect ({exc.os_error})", 503) from exc
    except aiohttp.ConnectionTimeoutError as exc:
        backend.mark_unhealthy("connect timed out")
        raise BackendFailure(backend, "unreachable", "connect timed out", 503) from exc
    except (asyncio.TimeoutError, aiohttp.ServerTimeoutError) as exc:
        raise BackendFailure(backend, "timeout", "timed out") from exc
    except (aiohttp.ClientError, ConnectionError) as exc:
        raise BackendFailure(backend, "disconnected", f"connection lost ({type(exc).__name__}: {exc})") from exc


def failure_from_status(backend: Backend, status: int, body: bytes) -> BackendFailure:
    kind = "unavailable" if status == 503 else "error"
    return BackendFailure(backend, kind, f"answered {status}: {_text(body)}", 503 if status == 503 else 502)


def _text(body: bytes) -> str:
    with contextlib.suppress(msgspec.DecodeError):
        decoded = msgspec.json.decode(body)
        if isinstance(decoded, dict) and isinstance(decoded.get("error"), dict):
            return str(decoded["error"].get("message", ""))[:MAX_ERROR_TEXT]
    return body[:MAX_ERROR_TEXT].decode("utf-8", "replace")
