"""POST /v1/completions."""

from __future__ import annotations

import time

from aiohttp import web

from mtpserve.server.completion_format import CompletionFormat
from mtpserve.server.context import CONTEXT
from mtpserve.server.engine_client import GenerateRequest
from mtpserve.server.errors import model_not_found
from mtpserve.server.generation import collect_response, stream_response
from mtpserve.server.prompts import tokenize_prompts
from mtpserve.server.sampling import check_fields, stop_strings, text_options, to_sampling_params
from mtpserve.server.schema import CompletionRequest, decode_body


def check_model(requested: str | None, served: str) -> None:
    if requested is not None and requested != served:
        raise model_not_found(requested)


async def create_completion(request: web.Request) -> web.StreamResponse:
    arrival = time.monotonic()
    ctx = request.app[CONTEXT]
    req = decode_body(await request.read(), CompletionRequest)
    check_model(req.model, ctx.settings.model_name)
    engine, limits = ctx.require_engine()
    check_fields(req, limits)
    prompts = await tokenize_prompts(req.prompt, ctx.text, limits)
    params = to_sampling_params(req, max(map(len, prompts.token_ids)), limits)
    n = req.n or 1
    stream = engine.submit(GenerateRequest(prompts.token_ids, params, n, stop_strings(req), arrival,
                                          **text_options(req)))
    fmt = CompletionFormat(ctx.settings.model_name, ctx.token_texts, prompts.texts if req.echo else None, n)
    if req.stream:
        return await stream_response(request, engine, stream, fmt, req.stream_options)
    return await collect_response(engine, stream, fmt)


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/completions", create_completion)
