"""A stand-in OpenAI-compatible server for the tests of `bench prefix` and `bench chat`: /v1/models,
/tokenize (one token per character), streamed /v1/completions and /v1/chat/completions answering one
character per token. It has no /metrics and no /reset_prefix_cache, and its usage carries neither
cached_tokens nor spec_decode: a server without prefix caching or speculation."""

from __future__ import annotations

import json

from aiohttp import web

MODEL = "fake"


def fake_app(max_model_len: int = 4096) -> web.Application:
    app = web.Application()

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": MODEL, "max_model_len": max_model_len}]})

    async def tokenize(request: web.Request) -> web.Response:
        tokens = [ord(c) for c in (await request.json())["prompt"]]
        return web.json_response({"count": len(tokens), "tokens": tokens})

    app.router.add_get("/v1/models", models)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/v1/chat/completions", _completions)
    return app


async def _completions(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    if "messages" in body:
        num_prompt = sum(len(m["content"]) for m in body["messages"])
        chunk = lambda text: {"choices": [{"index": 0, "delta": {"content": text}}]}  # noqa: E731
    else:
        num_prompt = len(body["prompt"])
        chunk = lambda text: {"choices": [{"index": 0, "text": text}]}  # noqa: E731
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for i in range(body["max_tokens"]):
        await response.write(_event(chunk(chr(ord("a") + (num_prompt + i) % 26))))
    usage = {"prompt_tokens": num_prompt, "completion_tokens": body["max_tokens"],
             "total_tokens": num_prompt + body["max_tokens"]}
    await response.write(_event({"choices": [], "usage": usage}))
    await response.write(b"data: [DONE]\n\n")
    return response


def _event(obj: dict) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()
