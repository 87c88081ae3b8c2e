"""POST /v1/completions (under PD, also a prefill's first token or a decode's continuation: pd_plan.py)."""

from __future__ import annotations

import time

from aiohttp import web

from mtpserve.server.completion_format import CompletionFormat
from mtpserve.server.context import CONTEXT
from mtpserve.server.engine_client import GenerateRequest
from mtpserve.web.errors import model_not_found
from mtpserve.server.generation import respond
from mtpserve.server.pd_plan import plan_pd
from mtpserve.server.prompts import Prompts, tokenize_prompts
from mtpserve.server.response_id import response_id
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
    pd = plan_pd(req, ctx.settings.pd_role, engine.ready, limits)
    if pd.remote is None:
        prompts = await tokenize_prompts(req.prompt, ctx.text, limits)
    else:  # NOTE: the prefill instance's tokens, not re-tokenized; its answer already echoed the prompt
        prompts = Prompts([pd.prompt_ids], [""])
    pd.check_num_prompts(len(prompts.token_ids))
    params, hold_kv = pd.sampling(to_sampling_params(req, max(map(len, prompts.token_ids)), limits))
    n = req.n or 1
    stream = engine.submit(GenerateRequest(prompts.token_ids, params, n, stop_strings(req), arrival,
                                          **text_options(req), hold_kv=hold_kv, remote=pd.remote))
    echo = prompts.texts if req.echo and pd.remote is None else None
    fmt = CompletionFormat(ctx.settings.model_name, ctx.token_texts, echo, n,
                           response_id(request.headers, "cmpl-"), {c.index: len(c.prior_text) for c in stream.choices})
    return await respond(request, engine, stream, fmt, req, pd.prefill, ctx.settings.kv_lease_timeout)


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/completions", create_completion)
