"""Drive one generation to the client: as an SSE stream, or collected into one JSON body.

Both paths release the stream in `finally`: a client that disconnects (the handler is cancelled,
or a write fails) aborts its engine requests, streaming or not.
"""

from __future__ import annotations

import contextlib
from typing import Protocol

import structlog
from aiohttp import web

from mtpserve.server.choice import ChoiceUpdate
from mtpserve.server.engine_client import EngineClient
from mtpserve.server.errors import ApiError
from mtpserve.server.schema import StreamOptions
from mtpserve.server.sse import SseWriter
from mtpserve.server.tracker import RequestStream
from mtpserve.server.usage import usage


class ResponseFormat(Protocol):
    response_id: str  # also sent as the X-Request-Id header

    def opening_chunks(self) -> list[dict]: ...
    def chunk(self, update: ChoiceUpdate) -> dict: ...
    def usage_chunk(self, usage: dict) -> dict: ...
    def body(self, updates: list[ChoiceUpdate], usage: dict) -> dict: ...


async def stream_response(request: web.Request, engine: EngineClient, stream: RequestStream,
                          fmt: ResponseFormat, options: StreamOptions | None) -> web.StreamResponse:
    writer = SseWriter(request)
    writer.response.headers["X-Request-Id"] = fmt.response_id
    bind_request(fmt.response_id)
    try:
        await writer.start()
        await _send_chunks(writer, engine, stream, fmt, options)
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


def bind_request(response_id: str) -> None:
    """Every later log line of this handler's task carries the request id (tasks copy contexts)."""
    structlog.contextvars.bind_contextvars(request_id=response_id)


def _with_usage(chunk: dict, with_usage: bool, value: dict | None) -> dict:
    if with_usage:
        chunk["usage"] = value
    return chunk


async def collect_response(engine: EngineClient, stream: RequestStream, fmt: ResponseFormat) -> web.Response:
    collected: dict[int, list[ChoiceUpdate]] = {c.index: [] for c in stream.choices}
    bind_request(fmt.response_id)
    try:
        while not stream.finished:
            for update in await engine.next_updates(stream):
                collected[update.index].append(update)
    finally:
        engine.release(stream)
    merged = [merge_updates(index, parts) for index, parts in sorted(collected.items())]
    return web.json_response(fmt.body(merged, usage(stream, engine.ready.num_speculative_tokens)),
                             headers={"X-Request-Id": fmt.response_id})


def merge_updates(index: int, parts: list[ChoiceUpdate]) -> ChoiceUpdate:
    def cat(name: str) -> list | None:
        values = [getattr(p, name) for p in parts]
        return None if not parts or values[0] is None else [x for v in values for x in v]

    finish = next((p.finish_reason for p in parts if p.finish_reason is not None), None)
    return ChoiceUpdate(index, "".join(p.text for p in parts), cat("token_ids") or [], cat("logprobs"),
                        cat("top_ids"), cat("top_logprobs"), finish)
