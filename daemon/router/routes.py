"""The router's API: the two generation routes (to a mixed instance, or through PD), /v1/models,
/health, /metrics, and the membership admin routes (membership.py).

A mixed request reserves its instance for its whole life. Under PD each generation request reserves
its decode instance for its whole life (it counts in that instance's in-flight number from the start),
the prefill instance for the prefill call only.
"""

from __future__ import annotations

import asyncio

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from mtpserve.router import membership
from mtpserve.router.backends import Backend, BackendPool, in_flight
from mtpserve.router.context import ROUTER, RouterContext
from mtpserve.router.drain import SHUTDOWN_MESSAGE, absorb_cut, is_shutdown
from mtpserve.router.failures import BackendFailure, backend_errors, failure_from_status
from mtpserve.router.metrics import BACKEND_ERROR, CLIENT_ERROR, DISCONNECTED
from mtpserve.router.pipeline_json import json_pd
from mtpserve.router.pipeline_mixed import json_mixed, stream_mixed
from mtpserve.router.pipeline_stream import Result, stream_pd
from mtpserve.router.request_body import is_stream, prepare_body
from mtpserve.router.prefix_index import prefix_keys, prompt_text
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
    chat = request.path == "/v1/chat/completions"
    body = prepare_body(await request.read(), completions=not chat, pd=ctx.is_pd)
    keys = prefix_keys(prompt_text(body, chat)) if ctx.config.policy == "cache_aware" else []
    stages = Stages(ctx.client, ctx.pools, ctx.metrics, request, body)
    if not ctx.is_pd:
        with in_flight(_choose(ctx, ctx.instance, keys)) as held:
            if is_stream(body):
                return await stream_mixed(stages, request, held, ctx.metrics)
            return await json_mixed(stages, held)
    prefill, decode = _choose(ctx, ctx.prefill, keys), _pick(ctx.decode)
    with in_flight(decode) as decode_held:
        if is_stream(body):
            return await stream_pd(stages, request, prefill, decode_held, ctx.metrics)
        return await json_pd(stages, prefill, decode_held)


def _choose(ctx: RouterContext, pool: BackendPool, keys: list[bytes]) -> Backend:
    """The pool's policy picks (policy.py); counted in the router's metrics."""
    chosen = pool.choose(keys)
    if chosen is None:
        raise ApiError(503, f"No healthy {pool.role} instance.", code="no_healthy_backend")
    backend, choice = chosen
    ctx.metrics.chosen(backend, choice.reason, choice.matched, len(keys))
    return backend


def _pick(pool: BackendPool) -> Backend:
    """The least loaded healthy instance of the pool (decode instances, /v1/models)."""
    backend = pool.pick()
    if backend is None:
        raise ApiError(503, f"No healthy {pool.role} instance.", code="no_healthy_backend")
    return backend


async def list_models(request: web.Request) -> web.Response:
    """A healthy instance's answer (a decode one under PD), as it gave it."""
    ctx = request.app[ROUTER]
    decode = _pick(ctx.decode if ctx.is_pd else ctx.instance)
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
    """200 while a request can be served (a healthy mixed instance, or a healthy prefill and decode
    instance); else 503 saying why."""
    ctx = request.app[ROUTER]
    backends = ({"instances": ctx.instance.describe()} if not ctx.is_pd else
                {"prefill": ctx.prefill.describe(), "decode": ctx.decode.describe()})
    if ctx.drain.draining:
        err = ApiError(503, SHUTDOWN_MESSAGE, code="shutting_down")
        return web.json_response({**err.body(), **backends}, status=503)
    if ctx.all_healthy_roles():
        return web.json_response({"status": "ok", **backends})
    missing = [p.role for p in ((ctx.prefill, ctx.decode) if ctx.is_pd else (ctx.instance,)) if p.num_healthy == 0]
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
    app.router.add_get("/admin/instances", membership.list_instances)
    app.router.add_post("/admin/instances", membership.replace_instances)
