"""The two backend calls of one request: their headers and bodies, and the one release it owes.

Both stages get the client's body (with its seed) and its Authorization header; the decode stage's
body adds `kv_transfer_params`. The header `X-PD-Stage` tells the instance which half to do.
`X-Request-Id`: the client's goes to the prefill, the prefill's answer's goes to the decode, so that
both halves of a stream carry one response id (server/response_id.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import aiohttp
import msgspec
from aiohttp import web

from mtpserve.router.backends import MIXED, Backend, BackendPool, Reservation
from mtpserve.router.failover import RETRYABLE, RETRYABLE_MIXED, first_answer
from mtpserve.router.failures import BackendFailure, BackendRejected
from mtpserve.router.metrics import RouterMetrics
from mtpserve.router.upstream import Upstream

STAGE_HEADER = "X-PD-Stage"
REQUEST_ID_HEADER = "X-Request-Id"


class Stages:
    def __init__(self, upstream: Upstream, pools: tuple[BackendPool, ...], metrics: RouterMetrics,
                 request: web.Request, body: dict) -> None:
        self.upstream = upstream
        self._pools = {pool.role: pool for pool in pools}
        self._metrics = metrics
        self.body = body
        self._path = request.path
        self.authorization = request.headers.get("Authorization")
        self.request_id = request.headers.get(REQUEST_ID_HEADER)  # then the prefill's answer's
        self._release: ReleaseOnce | None = None

    @contextlib.asynccontextmanager
    async def call(self, held: Reservation, stream: bool,
                   kv: dict | None = None) -> AsyncIterator[aiohttp.ClientResponse]:
        """`post` to the held backend, failing over to another of its role when it cannot take the
        request (failover.py); `held` ends on the backend that answered."""
        pool = self._pools[held.backend.role]
        retryable = RETRYABLE_MIXED if pool.role == MIXED else RETRYABLE
        async with first_answer(pool, held, lambda backend: self.post(backend, stream, kv),
                                self._metrics.failovers.labels(pool.role).inc, retryable) as response:
            yield response

    @contextlib.asynccontextmanager
    async def post(self, backend: Backend, stream: bool,
                   kv: dict | None = None) -> AsyncIterator[aiohttp.ClientResponse]:
        """The prefill call without `kv`, the decode call with it; one backend, no failover."""
        body = self.body if kv is None else {**self.body, "kv_transfer_params": kv}
        headers = {"Content-Type": "application/json"}
        if backend.role != MIXED:
            headers[STAGE_HEADER] = backend.role
        if self.authorization:
            headers["Authorization"] = self.authorization
        if self.request_id:
            headers[REQUEST_ID_HEADER] = self.request_id
        async with self.upstream.post(backend, self._path, msgspec.json.encode(body), headers, stream) as response:
            if kv is None:
                self.request_id = response.headers.get(REQUEST_ID_HEADER) or self.request_id
            yield response

    def release_once(self, prefill: Backend, kv: dict) -> ReleaseOnce:
        """The request's one release (the same object on every call)."""
        if self._release is None:
            transfer_id = kv.get("transfer_id")
            if not isinstance(transfer_id, int) or isinstance(transfer_id, bool):
                raise BackendFailure(prefill, "bad_body", "kv_transfer_params without an integer transfer_id")
            self._release = ReleaseOnce(self.upstream, prefill, transfer_id, self.authorization)
        return self._release


class ReleaseOnce:
    """Calling it sends POST /v1/pd/release the first time and does nothing afterwards."""

    def __init__(self, upstream: Upstream, prefill: Backend, transfer_id: int, authorization: str | None) -> None:
        self._args = (prefill, transfer_id, authorization)
        self._upstream: Upstream | None = upstream

    def __call__(self) -> None:
        if self._upstream is not None:
            upstream, self._upstream = self._upstream, None
            upstream.release(*self._args)


def passthrough(rejected: BackendRejected) -> web.Response:
    """The backend's 4xx answer, status and body unchanged."""
    return web.Response(status=rejected.status, body=rejected.body,
                        content_type=rejected.content_type or "application/json")
