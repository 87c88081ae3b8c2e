"""POST /v1/chat/completions (prompt rendered with the model's chat template; PD: pd_plan.py)."""

from __future__ import annotations

import time

from aiohttp import web

from mtpserve.server.chat_format import ChatFormat
from mtpserve.server.context import CONTEXT
from mtpserve.server.engine_client import GenerateRequest
from mtpserve.server.generation import respond
from mtpserve.server.pd_plan import plan_pd
from mtpserve.server.prompts import tokenize_chat
from mtpserve.server.response_id import response_id
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
    pd = plan_pd(req, ctx.settings.pd_role, engine.ready, limits)
    if pd.remote is None:
        prompt_ids = await tokenize_chat(req.messages, req.add_generation_prompt, ctx.text, limits)
    else:  # NOTE: the prefill instance's rendering, not re-rendered (the template may not be stable)
        prompt_ids = pd.prompt_ids
    params, hold_kv = pd.sampling(to_sampling_params(req, len(prompt_ids), limits))
    n = req.n or 1
    stream = engine.submit(GenerateRequest([prompt_ids], params, n, stop_strings(req), arrival,
                                          **text_options(req), hold_kv=hold_kv, remote=pd.remote))
    fmt = ChatFormat(ctx.settings.model_name, ctx.token_texts, n, response_id(request.headers, "chatcmpl-"),
                     with_role=pd.remote is None)
    return await respond(request, engine, stream, fmt, req, pd.prefill, ctx.settings.kv_lease_timeout)


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/chat/completions", create_chat_completion)
