"""The aiohttp application: middlewares, routes, and the engine connection as a cleanup context.

The server binds at once and answers /health with 503 until the engine reports ready, so a
supervisor can tell "starting" from "dead"; the connection is made in the background.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import structlog
from aiohttp import web

from mtpserve.ipc.request_channel import EngineReady, RequestChannelClient
from mtpserve.server import routes_chat, routes_completions, routes_misc, routes_pd
from mtpserve.config import Config, IpcConfig, PdConfig
from mtpserve.server.context import CONTEXT, ServerContext
from mtpserve.server.detokenizer import TokenTextCache
from mtpserve.server.engine_client import EngineClient
from mtpserve.server.health import EngineHealth
from mtpserve.server.metrics import ServerMetrics
from mtpserve.web.middlewares import api_key_middleware, content_type_middleware, error_middleware
from mtpserve.server.outputs import OutputSource
from mtpserve.server.pd_decode import DecodeRole
from mtpserve.server.pd_prefill import PrefillRole
from mtpserve.server.pd_role import ServingRole
from mtpserve.server.sampling import RequestLimits
from mtpserve.server.text_model import TextModel

log = structlog.get_logger("mtpserve.server")
OpenOutput = Callable[[EngineReady, IpcConfig], Awaitable[OutputSource]]


def make_app(config: Config, model_name: str, text: TextModel, runtime_dir: Path,
             open_output: OpenOutput) -> web.Application:
    server = config.server
    middlewares = [error_middleware]
    if server.api_key:
        middlewares.append(api_key_middleware(server.api_key))
    middlewares.append(content_type_middleware)
    app = web.Application(client_max_size=server.max_body_bytes, middlewares=middlewares)
    app[CONTEXT] = ServerContext(server, config.pd, config.ipc, model_name, serving_role(config.pd), text,
                                 ServerMetrics(model_name), EngineHealth(server.heartbeat_timeout),
                                 TokenTextCache(text))
    app.cleanup_ctx.append(_engine_connection(runtime_dir, open_output))
    app.on_shutdown.append(_start_draining)
    for routes in (routes_completions, routes_chat, routes_misc, routes_pd):
        routes.add_routes(app)
    return app


def serving_role(pd: PdConfig) -> ServingRole:
    """The instance's PD role on the HTTP side (docs/pd.md)."""
    if pd.role == "prefill":
        return PrefillRole(pd.kv_lease_timeout)
    return DecodeRole() if pd.role == "decode" else ServingRole()


def _engine_connection(runtime_dir: Path, open_output: OpenOutput):
    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        ctx = app[CONTEXT]
        task = asyncio.create_task(_connect(ctx, runtime_dir, open_output), name="engine-connect")
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        if ctx.engine is not None:
            await ctx.engine.close()

    return lifecycle


async def _connect(ctx: ServerContext, runtime_dir: Path, open_output: OpenOutput) -> None:
    """1. connect to rank 0's socket, 2. wait for EngineReady, 3. open the output path, 4. serve."""
    timeout = ctx.server.engine_ready_timeout
    try:
        channel = await RequestChannelClient.connect(runtime_dir, timeout)
        ready = await channel.wait_ready(timeout)
        output = await open_output(ready, ctx.ipc)
    except (TimeoutError, OSError) as exc:
        ctx.health.dead(f"engine did not become ready: {exc}")
        log.error("engine not ready", error=str(exc))
        return
    if ready.role != ctx.pd.role:  # NOTE: both come from one config; a mismatch is a wiring bug
        ctx.health.dead(f"engine role {ready.role!r} is not the configured pd.role {ctx.pd.role!r}")
        log.error("engine role mismatch", engine_role=ready.role, pd_role=ctx.pd.role)
        await output.close()
        await channel.close()
        return
    s = ctx.server
    ctx.limits = RequestLimits(max_model_len=ready.max_model_len, vocab_size=ready.vocab_size, max_n=s.max_n,
                               max_stop_strings=s.max_stop_strings, max_prompts=s.max_prompts_per_request,
                               max_top_logprobs=s.max_top_logprobs)
    ctx.engine = EngineClient(channel, output, ready, ctx.text, ctx.metrics, ctx.health, s.max_concurrent_requests)
    ctx.engine.start()
    log.info("engine ready", model=ready.model_name, max_model_len=ready.max_model_len)


async def _start_draining(app: web.Application) -> None:
    app[CONTEXT].health.draining()
