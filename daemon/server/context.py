"""Typed app state: what every handler reaches through `request.app[CONTEXT]`."""

from __future__ import annotations

from dataclasses import dataclass, field

from aiohttp import web

from mtpserve.server.detokenizer import TokenTextCache
from mtpserve.server.engine_client import EngineClient
from mtpserve.web.errors import ApiError
from mtpserve.server.health import EngineHealth
from mtpserve.server.metrics import ServerMetrics
from mtpserve.server.sampling import MAX_TOP_LOGPROBS, RequestLimits
from mtpserve.server.text_model import TextModel


@dataclass(frozen=True)
class HttpSettings:
    """The HTTP process's share of the configuration ([server] section)."""

    model_name: str
    api_key: str = ""
    max_concurrent_requests: int = 256
    max_body_bytes: int = 1 << 20
    max_top_logprobs: int = MAX_TOP_LOGPROBS
    max_n: int = 16
    max_stop_strings: int = 16
    max_prompts: int = 64
    engine_ready_timeout: float = 600.0
    heartbeat_timeout: float = 10.0
    pd_role: str = "mixed"  # [pd] role: mixed, prefill or decode (docs/pd.md)
    kv_lease_timeout: float = 30.0  # [pd]: how long a prefill waits for its engine's KVHeld at most


@dataclass
class ServerContext:
    settings: HttpSettings
    text: TextModel
    metrics: ServerMetrics
    health: EngineHealth
    token_texts: TokenTextCache
    engine: EngineClient | None = None
    limits: RequestLimits | None = field(default=None)

    def require_engine(self) -> tuple[EngineClient, RequestLimits]:
        """The engine client and the limits it reported; 503 while starting, draining or dead."""
        if self.engine is None or self.limits is None or not self.health.accepting:
            raise ApiError(503, f"The server is not accepting requests ({self.health.reason}).",
                           code="unavailable")
        return self.engine, self.limits


CONTEXT = web.AppKey("context", ServerContext)
