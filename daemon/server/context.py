"""Typed app state: what every handler reaches through `request.app[CONTEXT]`."""

from __future__ import annotations

from dataclasses import dataclass, field

from aiohttp import web

from mtpserve.config import IpcConfig, PdConfig, ServerConfig
from mtpserve.server.detokenizer import TokenTextCache
from mtpserve.server.engine_client import EngineClient
from mtpserve.server.health import EngineHealth
from mtpserve.server.metrics import ServerMetrics
from mtpserve.server.pd_role import ServingRole
from mtpserve.server.sampling import RequestLimits
from mtpserve.server.text_model import TextModel
from mtpserve.web.errors import ApiError


@dataclass
class ServerContext:
    server: ServerConfig  # the configuration's [server] section, as loaded
    pd: PdConfig  # its [pd] section
    ipc: IpcConfig  # its [ipc] section (the output reader's limits)
    model_name: str  # server.served_model_name, else the model directory's name
    role: ServingRole  # this instance's PD role (pd_role.py), chosen once
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
