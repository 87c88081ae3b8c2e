"""One streamed request through a prefill then a decode instance (docs/pd.md, steps 2-8).

1. POST the body to the prefill; a 4xx is passed through, a failure is a 502/503 (nothing sent yet).
   An instance that cannot take it is replaced by another of its role (failover.py), here and in 4.
2. Start the client's stream and relay the prefill's events, keeping back its `kv_transfer_params`
   event (and a `[DONE]`, should it send one).
3. No params: the first token ended the request; send `[DONE]`.
4. POST the body plus the params to the decode and relay its events, `[DONE]` included.
5. Release the prefill's KV after the decode's first event, or on any way out (failure, client
   disconnect, cancellation), exactly once.
A backend failure after step 2 ends the client's stream with an error event and `[DONE]`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import NamedTuple

import structlog
from aiohttp import web

from mtpserve.router.backends import Backend, Reservation, in_flight
from mtpserve.router.client_stream import ClientStream
from mtpserve.router.drain import SHUTDOWN_MESSAGE, absorb_cut, is_shutdown
from mtpserve.router.events import DONE, SseReader, is_error, kv_transfer_params
from mtpserve.router.failures import BackendFailure, BackendRejected
from mtpserve.router.metrics import BACKEND_ERROR, CLIENT_ERROR, COMPLETED, DISCONNECTED, PREFILL_ONLY, RouterMetrics
from mtpserve.router.stages import ReleaseOnce, Stages, passthrough
from mtpserve.web.errors import ApiError

log = structlog.get_logger("mtpserve.router")


class Result(NamedTuple):
    response: web.StreamResponse
    outcome: str


class PrefillRelay:
    """What the prefill's stream said, filled in as it arrives (so a cancelled relay still knows
    whether KV is held and needs its release)."""

    def __init__(self) -> None:
        self.prefill: Backend | None = None  # the instance that answered (after any failover)
        self.kv: dict | None = None  # None at the end: the request ended at the prefill
        self.had_error = False  # the prefill sent an error event


async def stream_pd(stages: Stages, request: web.Request, prefill: Backend, decode: Reservation,
                    metrics: RouterMetrics) -> Result:
    client = ClientStream(request, metrics)
    relay = PrefillRelay()

    async def prefill_then_decode() -> Result:
        await _prefill(stages, prefill, client, relay)
        if relay.kv is None:
            return Result(await client.finish(send_done=True), BACKEND_ERROR if relay.had_error else PREFILL_ONLY)
        assert relay.prefill is not None  # NOTE: set with relay.kv, by the prefill that answered
        release = stages.release_once(relay.prefill, relay.kv)
        await _decode(stages, decode, relay.kv, client, release, metrics)
        return Result(await client.finish(send_done=False), COMPLETED)

    try:
        return await guarded(client, request, prefill_then_decode)
    finally:
        _release_held(stages, relay)


async def guarded(client: ClientStream, request: web.Request, relay: Callable[[], Awaitable[Result]]) -> Result:
    """`relay()`'s result; a failure before the client's stream started is an HTTP error, after it an
    error event and `[DONE]`."""
    try:
        return await relay()
    except BackendRejected as rejected:
        if not client.started:
            return Result(passthrough(rejected), CLIENT_ERROR)
        return Result(await client.fail(rejected.error_body()), BACKEND_ERROR)
    except BackendFailure as failure:
        if not client.started:
            raise failure.api_error() from failure
        return Result(await client.fail(failure.api_error().body()), BACKEND_ERROR)
    except ConnectionError:  # NOTE: a write to our client failed: it left
        return Result(client.response, DISCONNECTED)
    except asyncio.CancelledError as exc:
        if not (is_shutdown(exc) and client.started):
            raise
        absorb_cut()  # NOTE: the drain ended: the client hears it in-band, like any failure after the start
        return Result(await client.fail(ApiError(503, SHUTDOWN_MESSAGE, code="shutting_down").body()),
                      BACKEND_ERROR)
    except Exception:  # NOTE: a bug must still end the stream in-band, never as a cut connection
        if not client.started:
            raise
        log.exception("router stream failed", path=request.path)
        return Result(await client.fail(ApiError(500, "Internal router error.").body()), BACKEND_ERROR)


def _release_held(stages: Stages, relay: PrefillRelay) -> None:
    """Release the prefill's KV if it is held; a repeat of an earlier release is a no-op."""
    if relay.kv is not None and relay.prefill is not None:
        with contextlib.suppress(BackendFailure):  # NOTE: no transfer_id, nothing we can release
            stages.release_once(relay.prefill, relay.kv)()


async def _prefill(stages: Stages, prefill: Backend, client: ClientStream, relay: PrefillRelay) -> None:
    with in_flight(prefill) as held:
        async with stages.call(held, stream=True) as response:
            relay.prefill = held.backend
            await client.start(response.headers.get("X-Request-Id"))
            await _relay_prefill(SseReader(response, prefill), client, relay)


async def _relay_prefill(reader: SseReader, client: ClientStream, relay: PrefillRelay) -> None:
    while (batch := await reader.next_batch()) is not None:
        kept = []
        for event in batch:
            params = kv_transfer_params(event)
            if params is not None:
                relay.kv = params
            elif event != DONE:
                kept.append(event)
                relay.had_error = relay.had_error or is_error(event)
        if kept:
            await client.write(b"".join(kept))


async def _decode(stages: Stages, decode: Reservation, kv: dict, client: ClientStream, release: ReleaseOnce,
                  metrics: RouterMetrics) -> None:
    handed_off = time.monotonic()
    async with stages.call(decode, stream=True, kv=kv) as response:
        reader = SseReader(response, decode.backend)
        batch = await reader.next_batch()
        release()
        metrics.handoff.observe(time.monotonic() - handed_off)
        await relay_to_done(reader, batch, client, decode.backend)


async def relay_to_done(reader: SseReader, batch: list[bytes] | None, client: ClientStream, backend: Backend) -> None:
    """Relay `batch` and the rest of `reader`'s events to the client, through the backend's `[DONE]`."""
    while batch is not None:
        if DONE in batch:
            await client.write(b"".join(batch[:batch.index(DONE) + 1]))
            return
        await client.write(b"".join(batch))
        batch = await reader.next_batch()
    raise BackendFailure(backend, "truncated", "ended its stream without [DONE]")
