"""Drive one generation to the client: as an SSE stream, or collected into one JSON body.

Both paths release the stream in `finally`: a client that disconnects (the handler is cancelled,
or a write fails) aborts its engine requests, streaming or not.

PD prefill (`handoff`): when the first token does not end the request, the answer ends with the
`kv_transfer_params` instead of usage and `[DONE]` (streamed: a last `data:` event; otherwise a
top-level field), and the stream is marked handed off so that its KV is not released with it.
"""

from __future__ import annotations

import contextlib
from typing import Protocol

import structlog
from aiohttp import web

from mtpserve.server.choice import ChoiceUpdate
from mtpserve.server.engine_client import EngineClient
from mtpserve.web.errors import ApiError
from mtpserve.server.pd_prefill import Handoff
from mtpserve.server.schema import SamplingFields, StreamOptions
from mtpserve.web.sse import SseWriter
from mtpserve.server.tracker import RequestStream
from mtpserve.server.usage import usage


class ResponseFormat(Protocol):
    response_id: str  # also sent as the X-Request-Id header

    def opening_chunks(self) -> list[dict]: ...
    def chunk(self, update: ChoiceUpdate) -> dict: ...
    def usage_chunk(self, usage: dict) -> dict: ...
    def body(self, updates: list[ChoiceUpdate], usage: dict) -> dict: ...


async def stream_response(request: web.Request, engine: EngineClient, stream: RequestStream,
                          fmt: ResponseFormat, options: StreamOptions | None,
                          handoff: Handoff | None = None) -> web.StreamResponse:
    writer = SseWriter(request)
    writer.response.headers["X-Request-Id"] = fmt.response_id
    bind_request(fmt.response_id)
    try:
        await writer.start()
        await _send_chunks(writer, engine, stream, fmt, options)
        params = await handoff.params(engine, stream) if handoff is not None else None
        if params is not None:
            return await _send_handoff(writer, stream, params)
        if options is not None and options.include_usage:
            await writer.send(fmt.usage_chunk(usage(stream, engine.ready.num_speculative_tokens)))
        return await writer.finish()
    except ApiError as err:
        with contextlib.suppress(ConnectionError):
            await writer.send_error(err)
            return await writer.finish()
        return writer.response
    except ConnectionError:
        return writer.response  # the client left; `finally` aborts its engine requests
    finally:
        engine.release(stream)


async def _send_chunks(writer: SseWriter, engine: EngineClient, stream: RequestStream, fmt: ResponseFormat,
                       options: StreamOptions | None) -> None:
    with_usage = options is not None and options.include_usage
    continuous = with_usage and options.continuous_usage_stats
    opening = fmt.opening_chunks()
    if opening:
        await writer.send_many([_with_usage(c, with_usage, None) for c in opening])
    while not stream.finished:
        chunks = [fmt.chunk(u) for u in await engine.next_updates(stream) if u.text or u.finish_reason
                  or u.token_ids]
        now_usage = usage(stream, engine.ready.num_speculative_tokens) if continuous else None
        if chunks:
            await writer.send_many([_with_usage(c, with_usage, now_usage) for c in chunks])


async def _send_handoff(writer: SseWriter, stream: RequestStream, params: dict) -> web.StreamResponse:
    """The last event of a prefill's answer; no usage chunk and no [DONE] (the decode instance's come)."""
    await writer.send({"kv_transfer_params": params})
    stream.handed_off.add(params["transfer_id"])
    await writer.response.write_eof()
    return writer.response


async def respond(request: web.Request, engine: EngineClient, stream: RequestStream, fmt: ResponseFormat,
                  req: SamplingFields, prefill: bool, kv_wait_timeout: float) -> web.StreamResponse:
    """Stream or collect, as the body asked; a PD prefill answers with its kv_transfer_params."""
    handoff = Handoff(engine.ready, kv_wait_timeout) if prefill else None
    if req.stream:
        return await stream_response(request, engine, stream, fmt, req.stream_options, handoff)
    return await collect_response(engine, stream, fmt, handoff)


def bind_request(response_id: str) -> None:
    """Every later log line of this handler's task carries the request id (tasks copy contexts)."""
    structlog.contextvars.bind_contextvars(request_id=response_id)


def _with_usage(chunk: dict, with_usage: bool, value: dict | None) -> dict:
    if with_usage:
        chunk["usage"] = value
    return chunk


async def collect_response(engine: EngineClient, stream: RequestStream, fmt: ResponseFormat,
                           handoff: Handoff | None = None) -> web.Response:
    collected: dict[int, list[ChoiceUpdate]] = {c.index: [] for c in stream.choices}
    bind_request(fmt.response_id)
    try:
        while not stream.finished:
            for update in await engine.next_updates(stream):
                collected[update.index].append(update)
        params = await handoff.params(engine, stream) if handoff is not None else None
        if params is not None:
            stream.handed_off.add(params["transfer_id"])
    finally:
        engine.release(stream)
    merged = [merge_updates(index, parts) for index, parts in sorted(collected.items())]
    body = fmt.body(merged, usage(stream, engine.ready.num_speculative_tokens))
    if params is not None:
        body["kv_transfer_params"] = params
    return web.json_response(body, headers={"X-Request-Id": fmt.response_id})


def merge_updates(index: int, parts: list[ChoiceUpdate]) -> ChoiceUpdate:
    def cat(name: str) -> list | None:
        values = [getattr(p, name) for p in parts]
        return None if not parts or values[0] is None else [x for v in values for x in v]

    finish = next((p.finish_reason for p in parts if p.finish_reason is not None), None)
    return ChoiceUpdate(index, "".join(p.text for p in parts), cat("token_ids") or [], cat("logprobs"),
                        cat("top_ids"), cat("top_logprobs"), finish)
