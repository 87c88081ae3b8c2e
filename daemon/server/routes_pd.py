"""POST /v1/pd/release: the router says a decode instance has (or will never read) a prefill's KV.

Body `{"transfer_ids": [int, ...]}` (the `transfer_id`s of kv_transfer_params) -> one ReleaseKV to
the engine, which ignores ids it no longer holds; answers `{"released": <ids forwarded>}`.
"""

from __future__ import annotations

import msgspec
from aiohttp import web

from mtpserve.server.context import CONTEXT
from mtpserve.web.errors import ApiError, bad_request
from mtpserve.server.schema import decode_body

MAX_IDS = 4096  # one router batch; far above what one body needs


class ReleaseRequest(msgspec.Struct, forbid_unknown_fields=True):
    transfer_ids: list[int]


async def release_kv(request: web.Request) -> web.Response:
    ctx = request.app[CONTEXT]
    req = decode_body(await request.read(), ReleaseRequest)
    engine = ctx.engine  # NOTE: not require_engine: a draining prefill must still free what it holds
    if engine is None:
        raise ApiError(503, "The engine is not connected.", code="unavailable")
    if ctx.pd.role != "prefill":
        raise bad_request(f"Only a prefill instance holds KV for others (this one is {ctx.pd.role}).",
                          "transfer_ids")
    ids = list(dict.fromkeys(req.transfer_ids))
    if len(ids) > MAX_IDS or any(i < 0 for i in ids):
        raise bad_request(f"`transfer_ids` must be at most {MAX_IDS} non-negative ids.", "transfer_ids")
    if ids:
        engine.release_kv(ids)
    return web.json_response({"released": len(ids)})


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/pd/release", release_kv)
