"""The router's state, one per app: configuration, backend pools, upstream session, metrics."""

from __future__ import annotations

from dataclasses import dataclass, field

from aiohttp import web

from mtpserve.router.backends import DECODE, MIXED, PREFILL, Backend, BackendPool
from mtpserve.router.config import Members, RouterConfig
from mtpserve.router.policy import PolicyConfig
from mtpserve.router.drain import Drain
from mtpserve.router.metrics import RouterMetrics
from mtpserve.router.upstream import Upstream


@dataclass
class RouterContext:
    config: RouterConfig
    instance: BackendPool  # mixed instances
    prefill: BackendPool
    decode: BackendPool
    metrics: RouterMetrics = field(default_factory=RouterMetrics)
    drain: Drain = field(default_factory=Drain)
    upstream: Upstream | None = None  # NOTE: made inside the loop (app cleanup context)

    @classmethod
    def create(cls, config: RouterConfig) -> RouterContext:
        policy = PolicyConfig(config.policy, config.cache_threshold, config.balance_abs_threshold,
                              config.balance_rel_threshold)
        ctx = cls(config, BackendPool(MIXED, (), policy, config.prefix_keys),
                  BackendPool(PREFILL, (), policy, config.prefix_keys), BackendPool(DECODE, ()))
        ctx.set_members(Members(config.instance_urls, config.prefill_urls, config.decode_urls))
        return ctx

    @property
    def pools(self) -> tuple[BackendPool, BackendPool, BackendPool]:
        return self.instance, self.prefill, self.decode

    @property
    def backends(self) -> list[Backend]:
        return [b for pool in self.pools for b in pool.backends]

    @property
    def is_pd(self) -> bool:
        return not self.instance.backends

    def members(self) -> Members:
        return Members(self.instance.urls, self.prefill.urls, self.decode.urls)

    def set_members(self, members: Members) -> list[Backend]:
        """Route to these instances from now on (requests in flight finish where they are); returns the
        instances added, whose health is still unknown."""
        problem = members.problem()
        if problem:
            raise ValueError(problem)
        added: list[Backend] = []
        urls = (members.instance_urls, members.prefill_urls, members.decode_urls)
        for pool, pool_urls in zip(self.pools, urls):
            new, gone = pool.set_urls(pool_urls)
            for backend in new:
                self.metrics.watch(backend)
            for backend in gone:
                self.metrics.unwatch(backend)
            added += new
        return added

    @property
    def client(self) -> Upstream:
        """The upstream session; it exists while the app runs (made in its cleanup context)."""
        if self.upstream is None:
            raise RuntimeError("the router's upstream session is not open")
        return self.upstream

    def all_healthy_roles(self) -> bool:
        """Some instance can take a request: a mixed one, or a prefill and a decode one."""
        if not self.is_pd:
            return self.instance.num_healthy > 0
        return self.prefill.num_healthy > 0 and self.decode.num_healthy > 0


ROUTER = web.AppKey("router", RouterContext)
