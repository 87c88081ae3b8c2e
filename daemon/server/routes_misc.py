"""GET /v1/models, /health, /metrics; POST /tokenize, /detokenize, /reset_prefix_cache."""

from __future__ import annotations

import time

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from mtpserve.server.context import CONTEXT
from mtpserve.web.errors import ApiError, bad_request
from mtpserve.server.prompts import tokenize_chat, tokenize_prompts
from mtpserve.server.routes_completions import check_model
from mtpserve.server.sampling import check_prompt_ids
from mtpserve.server.schema import DetokenizeRequest, TokenizeRequest, decode_body

_STARTED = int(time.time())
RESET_TIMEOUT_S = 10.0  # NOTE: the engine answers at its next intake, at most a step away


async def list_models(request: web.Request) -> web.Response:
    ctx = request.app[CONTEXT]
    card = {"id": ctx.model_name, "object": "model", "created": _STARTED, "owned_by": "mtpserve",
            "root": ctx.model_name,
            "max_model_len": ctx.limits.max_model_len if ctx.limits else None}
    return web.json_response({"object": "list", "data": [card]})


async def health(request: web.Request) -> web.Response:
    problem = request.app[CONTEXT].health.problem()
    if problem is None:
        return web.Response(status=200)
    return web.json_response({"status": "unhealthy", "reason": problem}, status=503)


async def metrics(request: web.Request) -> web.Response:
    ctx = request.app[CONTEXT]
    if ctx.engine is not None:
        ctx.metrics.observe_reader(ctx.engine.output_stats())
    body = ctx.metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def tokenize(request: web.Request) -> web.Response:
    ctx = request.app[CONTEXT]
    req = decode_body(await request.read(), TokenizeRequest)
    check_model(req.model, ctx.model_name)
    _, limits = ctx.require_engine()
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("Give exactly one of `prompt` and `messages`.", "prompt")
    if req.messages is not None:
        ids = await tokenize_chat(req.messages, req.add_generation_prompt, ctx.text, limits)
    else:
        prompts = await tokenize_prompts(req.prompt, ctx.text, limits, req.add_special_tokens) if req.prompt else None
        ids = prompts.token_ids[0] if prompts else []
    return web.json_response({"count": len(ids), "max_model_len": limits.max_model_len, "tokens": ids})


async def detokenize(request: web.Request) -> web.Response:
    ctx = request.app[CONTEXT]
    req = decode_body(await request.read(), DetokenizeRequest)
    check_model(req.model, ctx.model_name)
    _, limits = ctx.require_engine()
    if req.tokens:
        check_prompt_ids(req.tokens, limits, "tokens")
    return web.json_response({"prompt": ctx.text.decode(req.tokens)})


async def reset_prefix_cache(request: web.Request) -> web.Response:
    """vLLM's admin endpoint (behind the API key): the engine forgets every cached prefix. Any body is
    ignored. Every PD role serves it: each instance has its own cache."""
    engine = request.app[CONTEXT].engine  # NOTE: not require_engine: a draining instance may still reset
    if engine is None:
        raise ApiError(503, "The engine is not connected.", code="unavailable")
    return web.json_response({"num_blocks": await engine.reset_prefix_cache(RESET_TIMEOUT_S)})


def add_routes(app: web.Application) -> None:
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_post("/reset_prefix_cache", reset_prefix_cache)
