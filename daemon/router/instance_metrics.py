"""Each instance's own prefix-cache counters, scraped from its /metrics every `--metrics-interval`.

They feed `mtpserve:router_backend_prefix_cache_hit_rate` and /health's backend lists. The router's
`--api-key`, when set, goes along as the bearer token (instances behind one router share the key).
A failed scrape keeps the last figures: health is the poller's business (health.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import re

import aiohttp

from mtpserve.router.backends import Backend
from mtpserve.router.context import RouterContext

QUERIES = re.compile(r"^vllm:prefix_cache_queries_total(?:\{[^}]*\})? (\S+)$", re.M)
HITS = re.compile(r"^vllm:prefix_cache_hits_total(?:\{[^}]*\})? (\S+)$", re.M)


def counters(text: str) -> tuple[float, float] | None:
    """(queries, hits) summed over label sets; None when the instance exports neither."""
    queries, hits = QUERIES.findall(text), HITS.findall(text)
    if not queries and not hits:
        return None
    return sum(map(float, queries)), sum(map(float, hits))


async def scrape_forever(ctx: RouterContext) -> None:
    while True:
        await asyncio.gather(*(scrape(ctx, b) for b in ctx.backends if b.healthy))
        await asyncio.sleep(ctx.config.metrics_interval)


async def scrape(ctx: RouterContext, backend: Backend) -> None:
    headers = {"Authorization": f"Bearer {ctx.config.api_key}"} if ctx.config.api_key else None
    with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError):
        async with ctx.client.session.get(backend.url + "/metrics", headers=headers,
                                          timeout=ctx.client.short_timeout) as resp:
            if resp.status != 200:
                return
            found = counters(await resp.text(errors="replace"))
        if found is not None:
            backend.cache_queries, backend.cache_hits = found
