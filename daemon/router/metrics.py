"""Router metrics (Prometheus), one registry per app.

Names: `mtpserve:router_requests_total{route,outcome}`, `mtpserve:router_backend_errors_total{role,url,kind}`,
`mtpserve:router_time_to_first_token_seconds` (streams: arrival at the router to the first event
written to the client), `mtpserve:router_kv_handoff_seconds` (streams: prefill's last event to the
decode's first, i.e. the decode's KV read plus its first step), `mtpserve:router_releases_total{outcome}`,
`mtpserve:router_failovers_total{role}` (a request moved to another instance of the role: failover.py),
`mtpserve:router_backend_requests_total{role,url}` (requests each instance was chosen for),
`mtpserve:router_policy_decisions_total{role,reason}` (policy.py: cache, miss, balance, load, turn),
`mtpserve:router_policy_match_ratio{role}` (the share of the prompt the chosen instance had seen),
and gauges read at scrape time: `mtpserve:router_backend_in_flight{role,url}`,
`mtpserve:router_backend_healthy{role,url}`, `mtpserve:router_backend_prefix_cache_hit_rate{role,url}`
(the instance's own `vllm:prefix_cache_hits_total / queries_total`, scraped every `--metrics-interval`).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from mtpserve.router.backends import Backend

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)

# outcomes of one client request
COMPLETED = "completed"  # prefill then decode, to the end
PREFILL_ONLY = "prefill_only"  # the first token ended the request
CLIENT_ERROR = "client_error"  # 4xx: refused by the router or passed through from a backend
BACKEND_ERROR = "backend_error"  # 502/503, or an error event after the stream started
DISCONNECTED = "disconnected"  # the client went away


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("mtpserve:router_requests", "Client requests by route and outcome.",
                                ["route", "outcome"], registry=self.registry)
        self.backend_errors = Counter("mtpserve:router_backend_errors", "Failed backend calls.",
                                      ["role", "url", "kind"], registry=self.registry)
        self.ttft = Histogram("mtpserve:router_time_to_first_token_seconds",
                              "Streams: router arrival to the first event sent to the client.",
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.handoff = Histogram("mtpserve:router_kv_handoff_seconds",
                                 "Streams: prefill's kv_transfer_params to the decode's first event.",
                                 buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.releases = Counter("mtpserve:router_releases", "POST /v1/pd/release calls by outcome.",
                                ["outcome"], registry=self.registry)
        self.failovers = Counter("mtpserve:router_failovers", "Requests moved to another instance of a role.",
                                 ["role"], registry=self.registry)
        self.backend_requests = Counter("mtpserve:router_backend_requests", "Requests each instance was chosen for.",
                                        ["role", "url"], registry=self.registry)
        self.decisions = Counter("mtpserve:router_policy_decisions", "Why the policy chose an instance.",
                                 ["role", "reason"], registry=self.registry)
        self.match_ratio = Histogram("mtpserve:router_policy_match_ratio", "Share of a prompt the chosen "
                                     "instance had seen (cache_aware).", ["role"],
                                     buckets=(0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 1.0), registry=self.registry)
        self._hit_rate = Gauge("mtpserve:router_backend_prefix_cache_hit_rate", "The instance's prefix-cache "
                               "hits / queries (tokens, since its start), scraped.", ["role", "url"],
                               registry=self.registry)
        self._in_flight = Gauge("mtpserve:router_backend_in_flight", "Requests in flight per backend.",
                                ["role", "url"], registry=self.registry)
        self._healthy = Gauge("mtpserve:router_backend_healthy", "1 when the backend's /health answered 200.",
                              ["role", "url"], registry=self.registry)

    def watch(self, backend: Backend) -> None:
        """Gauges that read the backend's state when scraped (no bookkeeping on the request path)."""
        self._in_flight.labels(backend.role, backend.url).set_function(lambda: backend.in_flight)
        self._healthy.labels(backend.role, backend.url).set_function(lambda: float(backend.healthy))
        self._hit_rate.labels(backend.role, backend.url).set_function(lambda: backend.cache_hit_rate)

    def unwatch(self, backend: Backend) -> None:
        """A backend left the pool: its gauges go (its counters stay, as counters do)."""
        for gauge in (self._in_flight, self._healthy, self._hit_rate):
            gauge.remove(backend.role, backend.url)

    def chosen(self, backend: Backend, reason: str, matched: int, num_keys: int) -> None:
        self.backend_requests.labels(backend.role, backend.url).inc()
        self.decisions.labels(backend.role, reason).inc()
        if num_keys:
            self.match_ratio.labels(backend.role).observe(matched / num_keys)

    def outcome(self, route: str, outcome: str) -> None:
        self.requests.labels(route, outcome).inc()

    def backend_error(self, backend: Backend, kind: str) -> None:
        self.backend_errors.labels(backend.role, backend.url, kind).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
