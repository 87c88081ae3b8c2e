"""The router's API: the two generation routes through PD, /v1/models, /health, /metrics.

Each generation request reserves its decode instance for its whole life (it counts in that
instance's in-flight number from the start), the prefill instance for the prefill call only.
"""

from __future__ import annotations

import asyncio

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from mtpserve.router.backends import Backend, BackendPool, in_flight
from mtpserve.router.context import ROUTER, RouterContext
from mtpserve.router.drain import SHUTDOWN_MESSAGE, absorb_cut, is_shutdown
from mtpserve.router.failures import BackendFailure, backend_errors, failure_from_status
from mtpserve.router.metrics import BACKEND_ERROR, CLIENT_ERROR, DISCONNECTED
from mtpserve.router.pipeline_json import json_pd
from mtpserve.router.pipeline_stream import Result, stream_pd
from mtpserve.router.request_body import is_stream, prepare_body
from mtpserve.router.stages import Stages
from mtpserve.web.errors import ApiError

ROUTES = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}


async def generate(request: web.Request) -> web.StreamResponse:
    ctx = request.app[ROUTER]
    route = ROUTES[request.path]
    try:
        if ctx.drain.draining:
            raise ApiError(503, SHUTDOWN_MESSAGE, code="shutting_down")
        with ctx.drain.request():
            result = await _generate(request, ctx)
    except ApiError as err:
        ctx.metrics.outcome(route, CLIENT_ERROR if err.status < 500 else BACKEND_ERROR)
        raise
    except asyncio.CancelledError as exc:  # NOTE: aiohttp cancels the handler when the client disconnects
        if is_shutdown(exc):  # cut at the end of the drain before any byte went out (streams answer themselves)
            absorb_cut()
            ctx.metrics.outcome(route, BACKEND_ERROR)
            raise ApiError(503, SHUTDOWN_MESSAGE, code="shutting_down") from None
        ctx.metrics.outcome(route, DISCONNECTED)
        raise
    ctx.metrics.outcome(route, result.outcome)
    return result.response


async def _generate(request: web.Request, ctx: RouterContext) -> Result:
    body = prepare_body(await request.read(), completions=request.path == "/v1/completions")
    prefill, decode = _pick(ctx.prefill), _pick(ctx.decode)
    stages = Stages(ctx.client, (ctx.prefill, ctx.decode), ctx.metrics, request, body)
    with in_flight(decode) as decode_held:
        if is_stream(body):
            return await stream_pd(stages, request, prefill, decode_held, ctx.metrics)
        return await json_pd(stages, prefill, decode_held)


def _pick(pool: BackendPool) -> Backend:
    backend = pool.pick()
    if backend is None:
        raise ApiError(503, f"No healthy {pool.role} instance.", code="no_healthy_backend")
    return backend


async def list_models(request: web.Request) -> web.Response:
    """A healthy decode instance's answer, as it gave it."""
    ctx = request.app[ROUTER]
    decode = _pick(ctx.decode)
    auth = request.headers.get("Authorization")
    try:
        with backend_errors(decode):
            async with ctx.client.session.get(decode.url + "/v1/models", timeout=ctx.client.short_timeout,
                                                headers={"Authorization": auth} if auth else None) as resp:
                body = await resp.read()
    except BackendFailure as failure:
        raise failure.api_error() from failure
    if resp.status >= 500:
        raise failure_from_status(decode, resp.status, body).api_error()
    return web.Response(status=resp.status, body=body, content_type=resp.content_type)


async def health(request: web.Request) -> web.Response:
    """200 while at least one prefill and one decode instance are healthy; else 503 saying why."""
    ctx = request.app[ROUTER]
    backends = {"prefill": ctx.prefill.describe(), "decode": ctx.decode.describe()}
    if ctx.drain.draining:
        err = ApiError(503, SHUTDOWN_MESSAGE, code="shutting_down")
        return web.json_response({**err.body(), **backends}, status=503)
    if ctx.all_healthy_roles():
        return web.json_response({"status": "ok", **backends})
    missing = [p.role for p in (ctx.prefill, ctx.decode) if p.num_healthy == 0]
    err = ApiError(503, f"No healthy {' or '.join(missing)} instance.", code="no_healthy_backend")
    return web.json_response({**err.body(), **backends}, status=503)


async def metrics(request: web.Request) -> web.Response:
    body = request.app[ROUTER].metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def add_routes(app: web.Application) -> None:
    for path in ROUTES:
        app.router.add_post(path, generate)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
