"""POST /v1/chat/completions (prompt rendered with the model's chat template)."""

from __future__ import annotations

import time

from aiohttp import web

from mtpserve.server.chat_format import ChatFormat
from mtpserve.server.context import CONTEXT
from mtpserve.server.engine_client import GenerateRequest
from mtpserve.server.generation import collect_response, stream_response
from mtpserve.server.prompts import tokenize_chat
from mtpserve.server.routes_completions import check_model
from mtpserve.server.sampling import check_fields, stop_strings, text_options, to_sampling_params
from mtpserve.server.schema import ChatCompletionRequest, decode_body


async def create_chat_completion(request: web.Request) -> web.StreamResponse:
    arrival = time.monotonic()
    ctx = request.app[CONTEXT]
    req = decode_body(await request.read(), ChatCompletionRequest)
    check_model(req.model, ctx.settings.model_name)
    engine, limits = ctx.require_engine()
    check_fields(req, limits)
    prompt_ids = await tokenize_chat(req.messages, req.add_generation_prompt, ctx.text, limits)
    params = to_sampling_params(req, len(prompt_ids), limits)
    n = req.n or 1
    stream = engine.submit(GenerateRequest([prompt_ids], params, n, stop_strings(req), arrival,
                                          **text_options(req)))
    fmt = ChatFormat(ctx.settings.model_name, ctx.token_texts, n)
    if req.stream:
        return await stream_response(request, engine, stream, fmt, req.stream_options)
    return await collect_response(engine, stream, fmt)


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/chat/completions", create_chat_completion)
