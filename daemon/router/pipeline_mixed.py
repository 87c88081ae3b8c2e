"""One request through one mixed instance: the instance answers all of it, the router relays.

Streamed: the client's stream starts when the instance answered 200, and its events are relayed as they
come, `[DONE]` included; a failure after that ends the stream in-band (pipeline_stream.guarded). Not
streamed: the instance's body as it came. An instance that cannot take the request is replaced by
another one (failover.py), before anything reached the client.
"""

from __future__ import annotations

from aiohttp import web

from mtpserve.router.backends import Reservation
from mtpserve.router.client_stream import ClientStream
from mtpserve.router.events import SseReader
from mtpserve.router.failures import BackendFailure, BackendRejected
from mtpserve.router.metrics import CLIENT_ERROR, COMPLETED, RouterMetrics
from mtpserve.router.pipeline_stream import Result, guarded, relay_to_done
from mtpserve.router.stages import Stages, passthrough


async def stream_mixed(stages: Stages, request: web.Request, held: Reservation, metrics: RouterMetrics) -> Result:
    client = ClientStream(request, metrics)

    async def relay() -> Result:
        async with stages.call(held, stream=True) as response:
            await client.start(response.headers.get("X-Request-Id"))
            reader = SseReader(response, held.backend)
            await relay_to_done(reader, await reader.next_batch(), client, held.backend)
        return Result(await client.finish(send_done=False), COMPLETED)

    return await guarded(client, request, relay)


async def json_mixed(stages: Stages, held: Reservation) -> Result:
    try:
        async with stages.call(held, stream=False) as response:
            body = await response.read()
            request_id = response.headers.get("X-Request-Id")
    except BackendRejected as rejected:
        return Result(passthrough(rejected), CLIENT_ERROR)
    except BackendFailure as failure:
        raise failure.api_error() from failure
    headers = {"X-Request-Id": request_id} if request_id else None
    return Result(web.Response(body=body, content_type="application/json", headers=headers), COMPLETED)
