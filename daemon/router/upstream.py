"""Calls to the backends: one HTTP session, the stage headers, the timeouts, and the releases.

Streamed calls have no total limit, only an idle one (`stream_idle_timeout`: no byte for that long is
a failure); non-streamed calls have `request_timeout` in all. A response that is left before its end
is closed, not returned to the pool, so the backend sees the disconnect and aborts the request.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import aiohttp
import msgspec
import structlog

from mtpserve.router.backends import Backend
from mtpserve.router.config import RouterConfig
from mtpserve.router.failures import BackendFailure, BackendRejected, backend_errors, failure_from_status
from mtpserve.router.metrics import RouterMetrics

log = structlog.get_logger("mtpserve.router")
RELEASE_PATH = "/v1/pd/release"
RELEASE_TIMEOUT_S = 10.0
MAX_ERROR_BODY = 64 * 1024


class Upstream:
    def __init__(self, config: RouterConfig, metrics: RouterMetrics) -> None:
        self._config = config
        self._metrics = metrics
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),  # NOTE: concurrency is bounded by the instances
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=config.connect_timeout))
        self._stream_timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=config.connect_timeout, sock_read=config.stream_idle_timeout)
        self._json_timeout = aiohttp.ClientTimeout(
            total=config.request_timeout, sock_connect=config.connect_timeout)
        self.short_timeout = aiohttp.ClientTimeout(  # /health polls, /v1/models
            total=config.connect_timeout + max(2.0, config.health_interval))
        self._tasks: set[asyncio.Task] = set()

    @contextlib.asynccontextmanager
    async def post(self, backend: Backend, path: str, body: bytes, headers: dict[str, str],
                   stream: bool) -> AsyncIterator[aiohttp.ClientResponse]:
        """A 200 response of `backend`; raises BackendRejected (4xx) or BackendFailure."""
        timeout = self._stream_timeout if stream else self._json_timeout
        try:
            with backend_errors(backend):
                response = await self.session.post(backend.url + path, data=body, headers=headers,
                                                   timeout=timeout)
        except BackendFailure as failure:
            self._failed(failure)
            raise
        try:
            await self._check(backend, response)
            yield response
        except BaseException as exc:
            response.close()  # NOTE: drops the connection: the backend aborts the request
            if isinstance(exc, BackendFailure):
                self._failed(exc)
            raise
        response.release()

    def _failed(self, failure: BackendFailure) -> None:
        self._metrics.backend_error(failure.backend, failure.kind)
        log.warning("backend failed", role=failure.backend.role, backend=failure.backend.url, kind=failure.kind,
                    error=str(failure))

    async def _check(self, backend: Backend, response: aiohttp.ClientResponse) -> None:
        if response.status == 200:
            return
        with backend_errors(backend):
            body = await response.content.read(MAX_ERROR_BODY)
        if 400 <= response.status < 500:
            raise BackendRejected(backend, response.status, body, response.content_type)
        raise failure_from_status(backend, response.status, body)

    async def read_json(self, backend: Backend, response: aiohttp.ClientResponse) -> dict:
        with backend_errors(backend):
            raw = await response.read()
        try:
            body = msgspec.json.decode(raw)
        except msgspec.DecodeError as exc:
            raise BackendFailure(backend, "bad_body", f"answered malformed JSON ({exc})") from exc
        if not isinstance(body, dict):
            raise BackendFailure(backend, "bad_body", "answered JSON that is not an object")
        return body

    def release(self, prefill: Backend, transfer_id: int, authorization: str | None) -> None:
        """POST /v1/pd/release in the background (fire and forget; a failure is logged and counted)."""
        task = asyncio.get_running_loop().create_task(self._release(prefill, transfer_id, authorization))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _release(self, prefill: Backend, transfer_id: int, authorization: str | None) -> None:
        headers = {"Authorization": authorization} if authorization else {}
        timeout = aiohttp.ClientTimeout(total=RELEASE_TIMEOUT_S)
        try:
            async with self.session.post(prefill.url + RELEASE_PATH, json={"transfer_ids": [transfer_id]},
                                         headers=headers, timeout=timeout) as resp:
                await resp.read()
                ok = resp.status < 300
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            log.warning("kv release failed", backend=prefill.url, transfer_id=transfer_id, error=str(exc))
            self._metrics.releases.labels("failed").inc()
            return
        if not ok:
            log.warning("kv release refused", backend=prefill.url, transfer_id=transfer_id, status=resp.status)
        self._metrics.releases.labels("ok" if ok else "failed").inc()

    async def close(self, grace_s: float = 2.0) -> None:
        """Let pending releases finish (for at most grace_s), then close the session."""
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=grace_s)
        await self.session.close()
