"""The router's aiohttp application: the instance's middlewares, the routes, and a cleanup context
that owns the upstream session, the health poller and the instances' metrics scraper."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from aiohttp import web

from mtpserve.router import routes
from mtpserve.router.config import RouterConfig
from mtpserve.router.context import ROUTER, RouterContext
from mtpserve.router.health import poll_forever
from mtpserve.router.instance_metrics import scrape_forever
from mtpserve.router.upstream import Upstream
from mtpserve.web.middlewares import api_key_middleware, content_type_middleware, error_middleware

MAX_BODY_BYTES = 64 * 1024 * 1024  # NOTE: the instances apply their own (smaller) limit


def make_app(config: RouterConfig) -> web.Application:
    middlewares = [error_middleware]
    if config.api_key:
        middlewares.append(api_key_middleware(config.api_key))
    middlewares.append(content_type_middleware)
    app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=middlewares)
    app[ROUTER] = RouterContext.create(config)
    app.cleanup_ctx.append(_upstream)
    routes.add_routes(app)
    return app


async def _upstream(app: web.Application) -> AsyncIterator[None]:
    ctx = app[ROUTER]
    ctx.upstream = Upstream(ctx.config, ctx.metrics)
    pollers = [asyncio.create_task(poll_forever(ctx), name="backend-health"),
               asyncio.create_task(scrape_forever(ctx), name="backend-metrics")]
    yield
    for poller in pollers:
        poller.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await poller
    await ctx.upstream.close()
