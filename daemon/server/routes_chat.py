"""POST /v1/chat/completions: the prompt rendered with the model's chat template; otherwise as
routes_completions.py."""

from __future__ import annotations

import time

from aiohttp import web

from mtpserve.server.chat_format import ChatFormat
from mtpserve.server.context import CONTEXT
from mtpserve.server.engine_client import GenerateRequest
from mtpserve.server.engine_stream import EngineStream
from mtpserve.server.generation import respond
from mtpserve.server.prompts import tokenize_chat
from mtpserve.server.response_id import response_id
from mtpserve.server.routes_completions import check_model
from mtpserve.server.sampling import check_fields, stop_strings, text_options, to_sampling_params
from mtpserve.server.schema import ChatCompletionRequest, decode_body


async def create_chat_completion(request: web.Request) -> web.StreamResponse:
    arrival = time.monotonic()
    ctx = request.app[CONTEXT]
    req = decode_body(await request.read(), ChatCompletionRequest)
    check_model(req.model, ctx.model_name)
    engine, limits = ctx.require_engine()
    check_fields(req, limits)
    plan = ctx.role.plan(req, engine.ready, limits)
    prompt_ids = plan.prompt_ids
    if prompt_ids is None:  # NOTE: a continuation keeps the prefill's rendering (templates may not be stable)
        prompt_ids = await tokenize_chat(req.messages, req.add_generation_prompt, ctx.text, limits)
    params = plan.sampling(to_sampling_params(req, len(prompt_ids), limits))
    n = req.n or 1
    generation = engine.open(GenerateRequest([prompt_ids], params, n, stop_strings(req), arrival,
                                             **text_options(req), hold_kv=plan.hold_kv, remote=plan.remote))
    rid, with_role = response_id(request.headers, "chatcmpl-"), plan.prompt_ids is None

    def make_format(stream: EngineStream) -> ChatFormat:
        return ChatFormat(ctx.model_name, ctx.token_texts, n, rid, with_role=with_role)

    return await respond(request, generation, make_format, req, plan, engine.ready.num_speculative_tokens)


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/chat/completions", create_chat_completion)
