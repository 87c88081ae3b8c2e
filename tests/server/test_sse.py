"""SSE framing on the wire: `data: <json>\\n\\n` events, `[DONE]` last, errors in-band after the 200."""

import json

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from mtpserve.web.errors import ApiError
from mtpserve.web.sse import SseWriter, event


def test_event_bytes():
    assert event({"a": "é\n", "b": [1]}) == b'data: {"a":"\xc3\xa9\\n","b":[1]}\n\n'


async def _handler(request: web.Request) -> web.StreamResponse:
    writer = SseWriter(request)
    await writer.start()
    await writer.send({"i": 0})
    await writer.send_many([{"i": 1}, {"i": 2}])
    if request.query.get("fail"):
        await writer.send_error(ApiError(500, "boom", code="engine_error"))
    return await writer.finish()


@pytest.mark.parametrize("fail", [False, True])
async def test_stream_framing(fail):
    app = web.Application()
    app.router.add_get("/", _handler)
    async with TestClient(TestServer(app)) as client:
        resp = await client.get("/", params={"fail": "1"} if fail else {})
        assert resp.status == 200 and resp.headers["Content-Type"] == "text/event-stream"
        raw = await resp.read()
    assert raw.endswith(b"\n\n") and raw.count(b"data: [DONE]\n\n") == 1 and raw.endswith(b"data: [DONE]\n\n")
    events = [e.removeprefix(b"data: ") for e in raw.split(b"\n\n") if e]
    assert all(not e.startswith(b"data:") for e in events)
    bodies = [json.loads(e) for e in events[:-1]]
    assert bodies[:3] == [{"i": 0}, {"i": 1}, {"i": 2}]
    if fail:
        assert bodies[3] == {"error": {"message": "boom", "type": "server_error", "param": None,
                                       "code": "engine_error"}}
