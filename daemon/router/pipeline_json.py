"""One non-streamed request: the prefill's 1-token body, then the decode's body, merged (merge.py).

A body without `kv_transfer_params` already is the whole answer. The release goes out once the
decode answered or failed. A backend's 4xx is passed through; a failure is a 502/503. An instance
that cannot take the request is replaced by another of its role (failover.py).
"""

from __future__ import annotations

from aiohttp import web

from mtpserve.router.backends import Backend, Reservation, in_flight
from mtpserve.router.failures import BackendFailure, BackendRejected
from mtpserve.router.merge import merge_bodies
from mtpserve.router.metrics import CLIENT_ERROR, COMPLETED, PREFILL_ONLY
from mtpserve.router.pipeline_stream import Result
from mtpserve.router.stages import Stages, passthrough


async def json_pd(stages: Stages, prefill: Backend, decode: Reservation) -> Result:
    try:
        with in_flight(prefill) as held:
            first, request_id = await _call(stages, held)
        kv = first.pop("kv_transfer_params", None)
        if kv is None:
            return Result(_json(first, request_id), PREFILL_ONLY)
        release = stages.release_once(held.backend, kv)
        try:
            rest, _ = await _call(stages, decode, kv)
        finally:
            release()
        return Result(_json(merge_bodies(first, rest), request_id), COMPLETED)
    except BackendRejected as rejected:
        return Result(passthrough(rejected), CLIENT_ERROR)
    except BackendFailure as failure:
        raise failure.api_error() from failure


async def _call(stages: Stages, held: Reservation, kv: dict | None = None) -> tuple[dict, str | None]:
    async with stages.call(held, stream=False, kv=kv) as response:
        return await stages.upstream.read_json(held.backend, response), response.headers.get("X-Request-Id")


def _json(body: dict, request_id: str | None) -> web.Response:
    return web.json_response(body, headers={"X-Request-Id": request_id} if request_id else None)
