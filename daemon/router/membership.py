"""Who is behind the router, changed at run time: SIGHUP re-reads `--instances-file`, or the admin routes.

  * `GET /admin/instances`: `{"instance": [...], "prefill": [...], "decode": [...]}`, the current set.
  * `POST /admin/instances` with that shape replaces the set (behind the API key, as every route but
    /health); an impossible set (none, mixed and PD together, a bad URL) is a 400 and changes nothing.
New instances are checked at once and take requests as soon as their /health answers 200; removed ones
take no new request, and the requests in flight on them run to their end.
"""

from __future__ import annotations

import asyncio

import msgspec
import structlog
from aiohttp import web

from mtpserve.router.config import Members
from mtpserve.router.context import ROUTER, RouterContext
from mtpserve.router.health import check
from mtpserve.web.errors import bad_request, from_decode_error

log = structlog.get_logger("mtpserve.router")


class MembersBody(msgspec.Struct, forbid_unknown_fields=True):
    instance: list[str] = []
    prefill: list[str] = []
    decode: list[str] = []


def listing(ctx: RouterContext) -> dict[str, list[str]]:
    return listing_of(ctx.members())


async def list_instances(request: web.Request) -> web.Response:
    return web.json_response(listing(request.app[ROUTER]))


async def replace_instances(request: web.Request) -> web.Response:
    ctx = request.app[ROUTER]
    try:
        body = msgspec.json.decode(await request.read(), type=MembersBody)
    except msgspec.DecodeError as exc:
        raise from_decode_error(exc) from exc
    try:
        await apply(ctx, Members.of(body.instance, body.prefill, body.decode), "admin")
    except ValueError as exc:
        raise bad_request(str(exc), None, "invalid_instances") from exc
    return web.json_response(listing(ctx))


def reload_file(ctx: RouterContext) -> None:
    """SIGHUP: route to the instances `--instances-file` names now; a bad file is logged and ignored."""
    path = ctx.config.instances_file
    if not path:
        log.warning("SIGHUP ignored: the router was started without --instances-file")
        return
    try:
        members = Members.read(path)
        task = asyncio.get_running_loop().create_task(apply(ctx, members, "SIGHUP"))
    except (OSError, ValueError) as exc:
        log.error("instances file not applied", path=path, error=str(exc))
        return
    task.add_done_callback(_log_failure)


def _log_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("instances file not applied", error=str(task.exception()))


async def apply(ctx: RouterContext, members: Members, source: str) -> None:
    """Make `members` the router's instances (ValueError if impossible), then check the new ones."""
    before = ctx.members()
    added = ctx.set_members(members)
    log.info("instances changed", source=source, before=listing_of(before), after=listing_of(members))
    await asyncio.gather(*(check(ctx, backend) for backend in added))


def listing_of(members: Members) -> dict[str, list[str]]:
    return {"instance": list(members.instance_urls), "prefill": list(members.prefill_urls),
            "decode": list(members.decode_urls)}
