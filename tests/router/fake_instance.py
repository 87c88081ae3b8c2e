"""A stand-in for an mtpserve instance at its HTTP boundary, following docs/pd.md's wire contract.

Roles: `mixed` answers the whole request (the reference a PD answer must equal), `prefill` (header
`X-PD-Stage: prefill`) answers the first token plus `kv_transfer_params`, `decode` (header
`X-PD-Stage: decode`, body with the params) answers the tokens after the first. A request's
`X-Request-Id` header becomes its response id (and the answer's `X-Request-Id`). The "model" emits
`max_tokens` tokens ` w<seed % 1000 + i>`, token i with logprob -(i + 1) / 10.

Knobs set by tests: `health_status`, `reject` (400 to every generation), `crash` (500), `unavailable`
(503, as a draining instance answers), `die_before_answer` (the connection reset first), `die_after`
(events sent before the transport is aborted), `hang_after` (events before it stops sending), `end_after` (events before
the body ends cleanly), `event_delay` (seconds before each group of events),
`no_kv` (the first token ends the request).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

from aiohttp import web
from aiohttp.test_utils import TestServer

CREATED = 1_700_000_000


@dataclass
class Seen:
    path: str
    stage: str | None
    authorization: str | None
    body: dict
    headers_id: str | None  # the X-Request-Id header it was sent


class FakeInstance:
    def __init__(self, role: str) -> None:
        self.role = role
        self.seen: list[Seen] = []
        self.releases: list[list[int]] = []
        self.health_status = 200
        self.reject = self.crash = self.unavailable = self.no_kv = False
        self.die_after: int | None = None
        self.die_before_answer = False  # the connection is reset before any byte of the answer
        self.hang_after: int | None = None
        self.end_after: int | None = None
        self.event_delay = 0.0
        self.die_with_reset = True
        self.cancelled = asyncio.Event()
        self._next_transfer_id = 100
        app = web.Application()
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_post("/v1/chat/completions", self._generate)
        app.router.add_post("/v1/pd/release", self._release)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        self.server = TestServer(app, handler_cancellation=True)

    @property
    def url(self) -> str:
        return str(self.server.make_url("")).rstrip("/")

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=self.health_status)

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake", "object": "model", "owned_by": self.role}]})

    async def _release(self, request: web.Request) -> web.Response:
        self.releases.append((await request.json())["transfer_ids"])
        return web.json_response({"released": len(self.releases[-1])})

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        stage = request.headers.get("X-PD-Stage")
        self.seen.append(Seen(request.path, stage, request.headers.get("Authorization"), body,
                              request.headers.get("X-Request-Id")))
        if self.reject or (stage == "decode" and "kv_transfer_params" not in body):
            return web.json_response({"error": {"message": "bad request from fake", "type": "invalid_request_error",
                                                "param": "prompt", "code": None}}, status=400)
        if self.die_before_answer:
            transport = request.transport
            assert transport is not None
            transport.abort()
            return web.Response()
        if self.crash:
            return web.Response(status=500, text="boom")
        if self.unavailable:
            return web.json_response({"error": {"message": "draining", "type": "service_unavailable_error",
                                                "param": None, "code": None}}, status=503)
        plan = _Plan(self, request.path == "/v1/chat/completions", stage, body, request.headers.get("X-Request-Id"))
        if body.get("stream"):
            return await self._stream(request, plan)
        await asyncio.sleep(self.event_delay * len(plan.event_groups()))  # NOTE: as long as its stream
        return web.json_response(plan.whole_body(), headers={"X-Request-Id": plan.head["id"]})

    async def _stream(self, request: web.Request, plan: _Plan) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "X-Request-Id": plan.head["id"]})
        await response.prepare(request)
        try:
            groups = plan.event_groups()
            for i in range(len(groups) + 1):  # NOTE: the knobs may also hit the end of the body
                if i == self.die_after:  # NOTE: like a killed process: no chunked end, a reset or a FIN
                    transport = request.transport
                    assert transport is not None
                    transport.abort() if self.die_with_reset else transport.close()
                    return response
                if i == self.end_after:
                    break  # a clean end of the body, too early
                if i == self.hang_after:
                    await asyncio.sleep(3600)
                if i < len(groups):
                    await asyncio.sleep(self.event_delay)
                    await response.write(b"".join(map(_event, groups[i])))
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        await response.write_eof()
        return response

    def take_transfer_id(self) -> int:
        self._next_transfer_id += 1
        return self._next_transfer_id


def _event(obj: dict | str) -> bytes:
    return b"data: " + (b"[DONE]" if obj == "[DONE]" else json.dumps(obj).encode()) + b"\n\n"


class _Plan:
    """Which tokens this role answers for one request, and in which shapes."""

    def __init__(self, fake: FakeInstance, chat: bool, stage: str | None, body: dict, given_id: str | None) -> None:
        self.chat, self.stage, self.body = chat, stage, body
        max_tokens = body.get("max_tokens", 5)
        base = body.get("seed", 0) % 1000
        tokens = [f" w{base + i}" for i in range(max_tokens)]
        ends_first = fake.no_kv or max_tokens == 1
        self.kv = None
        if stage == "prefill":
            self.first, self.tokens = 0, tokens[:1]
            if not ends_first:
                self.kv = {"transfer_id": fake.take_transfer_id(), "kv_session": "127.0.0.1:1",
                           "block_ids": [3, 4], "prompt_token_ids": [1, 2, 3], "first_token_id": 7,
                           "draft_token_ids": [8], "lease_expires_in": 30.0}
        else:
            self.first = 1 if stage == "decode" else 0
            self.tokens = tokens[self.first:]
        # NOTE: the decode knows the first token, so its text_offset continues after it
        self.text_base = len(tokens[0]) if stage == "decode" else 0
        self.finish = None if self.kv is not None else "length"
        self.kind = "chat.completion" if chat else "text_completion"
        # NOTE: like server/response_id.py: a given X-Request-Id is the response id
        self.head = {"id": given_id or f"{'chatcmpl' if chat else 'cmpl'}-{fake.role}", "created": CREATED,
                     "model": "fake"}
        self.usage = {"prompt_tokens": 3, "completion_tokens": max_tokens, "total_tokens": 3 + max_tokens}

    def _logprob(self, i: int) -> float:
        return -(self.first + i + 1) / 10

    def _completion_logprobs(self, indices: range, base_offset: int) -> dict | None:
        if self.body.get("logprobs") is None:
            return None
        toks = [self.tokens[i] for i in indices]
        offsets = [self.text_base + base_offset + sum(map(len, self.tokens[indices.start:i])) for i in indices]
        return {"tokens": toks, "token_logprobs": [self._logprob(i) for i in indices],
                "top_logprobs": [{t: self._logprob(i)} for t, i in zip(toks, indices)], "text_offset": offsets}

    def _chat_logprobs(self, indices: range) -> dict | None:
        if not self.body.get("logprobs"):
            return None
        return {"content": [{"token": self.tokens[i], "logprob": self._logprob(i),
                             "bytes": list(self.tokens[i].encode()), "top_logprobs": []} for i in indices]}

    def _finish(self, i: int) -> str | None:
        return self.finish if i == len(self.tokens) - 1 else None

    def _chunk(self, i: int, offset: int) -> dict:
        one = range(i, i + 1)
        if self.chat:
            choice = {"index": 0, "delta": {"content": self.tokens[i]}, "logprobs": self._chat_logprobs(one),
                      "finish_reason": self._finish(i)}
            return {**self.head, "object": "chat.completion.chunk", "choices": [choice]}
        choice = {"index": 0, "text": self.tokens[i], "logprobs": self._completion_logprobs(one, offset),
                  "finish_reason": self._finish(i)}
        return {**self.head, "object": self.kind, "choices": [choice]}

    def event_groups(self) -> list[list[dict | str]]:  # NOTE: str: the closing [DONE]
        """Events by write: a role chunk (chat, not on decode), tokens in pairs (one write each, as
        several accepted drafts would be), the params (prefill), usage (not on prefill), [DONE]."""
        groups: list[list[dict | str]] = []
        if self.chat and self.stage != "decode":
            groups.append([{**self.head, "object": "chat.completion.chunk",
                            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                         "logprobs": None, "finish_reason": None}]}])
        offsets = [sum(map(len, self.tokens[:i])) for i in range(len(self.tokens))]
        chunks: list[dict | str] = [self._chunk(i, offsets[i]) for i in range(len(self.tokens))]
        groups += [chunks[i:i + 2] for i in range(0, len(chunks), 2)]
        if self.kv is not None:
            groups.append([{"kv_transfer_params": self.kv}])
        options = self.body.get("stream_options") or {}
        if self.stage != "prefill" and options.get("include_usage"):
            groups.append([{**self.head, "object": "chat.completion.chunk" if self.chat else self.kind,
                            "choices": [], "usage": self.usage}])
        if self.stage != "prefill":
            groups.append(["[DONE]"])
        return groups

    def whole_body(self) -> dict:
        text, indices = "".join(self.tokens), range(len(self.tokens))
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": self._chat_logprobs(indices), "finish_reason": self.finish}
        else:
            choice = {"index": 0, "text": text, "logprobs": self._completion_logprobs(indices, 0),
                      "finish_reason": self.finish}
        body = {**self.head, "object": self.kind, "choices": [choice], "usage": self.usage}
        if self.kv is not None:
            body["kv_transfer_params"] = self.kv
        return body
