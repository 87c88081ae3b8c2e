"""The router's state, one per app: configuration, backend pools, upstream session, metrics."""

from __future__ import annotations

from dataclasses import dataclass, field

from aiohttp import web

from mtpserve.router.backends import DECODE, PREFILL, BackendPool
from mtpserve.router.config import RouterConfig
from mtpserve.router.drain import Drain
from mtpserve.router.metrics import RouterMetrics
from mtpserve.router.upstream import Upstream


@dataclass
class RouterContext:
    config: RouterConfig
    prefill: BackendPool
    decode: BackendPool
    metrics: RouterMetrics = field(default_factory=RouterMetrics)
    drain: Drain = field(default_factory=Drain)
    upstream: Upstream | None = None  # NOTE: made inside the loop (app cleanup context)

    @classmethod
    def create(cls, config: RouterConfig) -> RouterContext:
        ctx = cls(config, BackendPool(PREFILL, config.prefill_urls), BackendPool(DECODE, config.decode_urls))
        for backend in [*ctx.prefill.backends, *ctx.decode.backends]:
            ctx.metrics.watch(backend)
        return ctx

    @property
    def client(self) -> Upstream:
        """The upstream session; it exists while the app runs (made in its cleanup context)."""
        if self.upstream is None:
            raise RuntimeError("the router's upstream session is not open")
        return self.upstream

    def all_healthy_roles(self) -> bool:
        return self.prefill.num_healthy > 0 and self.decode.num_healthy > 0


ROUTER = web.AppKey("router", RouterContext)
