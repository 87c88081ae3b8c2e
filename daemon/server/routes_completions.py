"""POST /v1/completions: decode -> validate -> the role's plan (pd_role.py) -> open the generation ->
respond (generation.py)."""

from __future__ import annotations

import time

from aiohttp import web

from mtpserve.server.completion_format import CompletionFormat
from mtpserve.server.context import CONTEXT
from mtpserve.server.engine_client import GenerateRequest
from mtpserve.server.engine_stream import EngineStream
from mtpserve.server.generation import respond
from mtpserve.server.prompts import Prompts, tokenize_prompts
from mtpserve.server.response_id import response_id
from mtpserve.server.sampling import check_fields, stop_strings, text_options, to_sampling_params
from mtpserve.server.schema import CompletionRequest, decode_body
from mtpserve.web.errors import model_not_found


def check_model(requested: str | None, served: str) -> None:
    if requested is not None and requested != served:
        raise model_not_found(requested)


async def create_completion(request: web.Request) -> web.StreamResponse:
    arrival = time.monotonic()
    ctx = request.app[CONTEXT]
    req = decode_body(await request.read(), CompletionRequest)
    check_model(req.model, ctx.model_name)
    engine, limits = ctx.require_engine()
    check_fields(req, limits)
    plan = ctx.role.plan(req, engine.ready, limits)
    if plan.prompt_ids is None:
        prompts = await tokenize_prompts(req.prompt, ctx.text, limits)
    else:  # NOTE: a continuation: the prompt was echoed (if asked) by the instance that prefilled it
        prompts = Prompts([plan.prompt_ids], [""])
    plan.check_num_prompts(len(prompts.token_ids))
    params = plan.sampling(to_sampling_params(req, max(map(len, prompts.token_ids)), limits))
    n = req.n or 1
    generation = engine.open(GenerateRequest(prompts.token_ids, params, n, stop_strings(req), arrival,
                                             **text_options(req), hold_kv=plan.hold_kv, remote=plan.remote))
    echo = prompts.texts if req.echo and plan.prompt_ids is None else None
    rid = response_id(request.headers, "cmpl-")

    def make_format(stream: EngineStream) -> CompletionFormat:
        offsets = {c.index: len(c.prior_text) for c in stream.choices}
        return CompletionFormat(ctx.model_name, ctx.token_texts, echo, n, rid, offsets)

    return await respond(request, generation, make_format, req, plan, engine.ready.num_speculative_tokens)


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/completions", create_completion)
