"""Backend health: every `health_interval` seconds, GET /health of every backend, all at once.

200 marks a backend healthy; anything else (503 while starting or draining, a refused connection,
no answer within the short timeout) marks it unhealthy with the reason, shown by the router's /health.
A refused connection during a request marks the backend unhealthy at once (failures.py).
"""

from __future__ import annotations

import asyncio

import aiohttp
import structlog

from mtpserve.router.backends import Backend
from mtpserve.router.context import RouterContext

log = structlog.get_logger("mtpserve.router")


async def poll_forever(ctx: RouterContext) -> None:
    while True:
        await asyncio.gather(*(check(ctx, b) for b in ctx.backends))  # NOTE: the members of now
        await asyncio.sleep(ctx.config.health_interval)


async def check(ctx: RouterContext, backend: Backend) -> None:
    was_healthy = backend.healthy
    try:
        async with ctx.client.session.get(backend.url + "/health", timeout=ctx.client.short_timeout) as resp:
            text = (await resp.text(errors="replace"))[:300]
            status = resp.status
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
        backend.mark_unhealthy(f"/health failed: {type(exc).__name__}: {exc}")
    else:
        if status == 200:
            backend.mark_healthy()
        else:
            backend.mark_unhealthy(f"/health answered {status}: {text}")
    if backend.healthy != was_healthy:
        log.info("backend health changed", backend=backend.url, role=backend.role, healthy=backend.healthy,
                 reason=backend.last_error or None)
