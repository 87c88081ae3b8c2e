"""Drive one generation to the client: as an SSE stream, or collected into one JSON body.

Both paths run inside the EngineStream's `async with`, so a client that disconnects (the handler is
cancelled, or a write fails) aborts its engine requests, streaming or not. How the answer ends is the
role plan's (pd_role.py): usage and `[DONE]`, or, for a PD prefill whose first token does not end the
request, the `kv_transfer_params` (streamed: a last `data:` event; otherwise a top-level field).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Protocol

import structlog
from aiohttp import web

from mtpserve.server.choice import ChoiceUpdate
from mtpserve.server.engine_stream import EngineStream
from mtpserve.server.pd_role import RolePlan
from mtpserve.server.schema import SamplingFields, StreamOptions
from mtpserve.server.usage import usage
from mtpserve.web.errors import ApiError
from mtpserve.web.sse import SseWriter


class ResponseFormat(Protocol):
    @property
    def response_id(self) -> str: ...  # also sent as the X-Request-Id header

    def opening_chunks(self) -> list[dict]: ...
    def chunk(self, update: ChoiceUpdate) -> dict: ...
    def usage_chunk(self, usage: dict) -> dict: ...
    def body(self, updates: list[ChoiceUpdate], usage: dict) -> dict: ...


MakeFormat = Callable[[EngineStream], ResponseFormat]  # the format needs the registered choices


async def respond(request: web.Request, generation: EngineStream, make_format: MakeFormat,
                  req: SamplingFields, plan: RolePlan, num_speculative_tokens: int) -> web.StreamResponse:
    """Stream or collect, as the body asked."""
    if req.stream:
        return await stream_response(request, generation, make_format, req.stream_options, plan,
                                     num_speculative_tokens)
    async with generation as stream:
        return await collect_response(stream, make_format(stream), plan, num_speculative_tokens)


async def stream_response(request: web.Request, generation: EngineStream, make_format: MakeFormat,
                          options: StreamOptions | None, plan: RolePlan,
                          num_speculative_tokens: int) -> web.StreamResponse:
    writer = SseWriter(request)
    async with generation as stream:
        fmt = make_format(stream)
        writer.response.headers["X-Request-Id"] = fmt.response_id
        bind_request(fmt.response_id)
        try:
            await writer.start()
            await _send_chunks(writer, stream, fmt, options, num_speculative_tokens)
            params = await plan.handoff(stream)
            if params is not None:
                return await _send_handoff(writer, params)
            if options is not None and options.include_usage:
                await writer.send(fmt.usage_chunk(usage(stream.requests, num_speculative_tokens)))
            return await writer.finish()
        except ApiError as err:
            with contextlib.suppress(ConnectionError):
                await writer.send_error(err)
                return await writer.finish()
            return writer.response
        except ConnectionError:
            return writer.response  # the client left; leaving `async with` aborts its engine requests


async def _send_chunks(writer: SseWriter, stream: EngineStream, fmt: ResponseFormat,
                       options: StreamOptions | None, num_speculative_tokens: int) -> None:
    with_usage = options is not None and options.include_usage
    continuous = options is not None and options.include_usage and options.continuous_usage_stats
    opening = fmt.opening_chunks()
    if opening:
        await writer.send_many([_with_usage(c, with_usage, None) for c in opening])
    async for updates in stream:
        chunks = [fmt.chunk(u) for u in updates if u.text or u.finish_reason or u.token_ids]
        now_usage = usage(stream.requests, num_speculative_tokens) if continuous else None
        if chunks:
            await writer.send_many([_with_usage(c, with_usage, now_usage) for c in chunks])


async def _send_handoff(writer: SseWriter, params: dict[str, object]) -> web.StreamResponse:
    """The last event of a prefill's answer; no usage chunk and no [DONE] (the decode instance's come)."""
    await writer.send({"kv_transfer_params": params})
    await writer.response.write_eof()
    return writer.response


def bind_request(response_id: str) -> None:
    """Every later log line of this handler's task carries the request id (tasks copy contexts)."""
    structlog.contextvars.bind_contextvars(request_id=response_id)


def _with_usage(chunk: dict, with_usage: bool, value: dict | None) -> dict:
    if with_usage:
        chunk["usage"] = value
    return chunk


async def collect_response(stream: EngineStream, fmt: ResponseFormat, plan: RolePlan,
                           num_speculative_tokens: int) -> web.Response:
    collected: dict[int, list[ChoiceUpdate]] = {c.index: [] for c in stream.choices}
    bind_request(fmt.response_id)
    async for updates in stream:
        for update in updates:
            collected[update.index].append(update)
    params = await plan.handoff(stream)
    merged = [merge_updates(index, parts) for index, parts in sorted(collected.items())]
    body = fmt.body(merged, usage(stream.requests, num_speculative_tokens))
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
