"""Backends that are down or answer badly before the client's stream starts: OpenAI-shaped 502/503,
never a traceback, never a hung client."""

from __future__ import annotations

import pytest

from router_harness import start_router


def _assert_error(body: dict, status: int, code: str) -> None:
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == code
    assert body["error"]["type"] == "service_unavailable_error"


@pytest.mark.parametrize("router_options", [{"health_interval": 60.0}])  # the router still thinks P is up
@pytest.mark.parametrize("stream", [False, True])
async def test_prefill_gone_is_503(router, prefill, decode, stream):
    await prefill.server.close()
    resp = await router.post("/v1/completions", json={"prompt": "x", "stream": stream})
    assert resp.status == 503
    _assert_error(await resp.json(), 503, "backend_unreachable")
    health = await router.get("/health")  # the refused connection marked it unhealthy at once
    assert health.status == 503 and (await health.json())["prefill"][0]["healthy"] is False


@pytest.mark.parametrize("stream", [False, True])
async def test_prefill_5xx_is_502(router, prefill, decode, stream):
    prefill.crash = True
    resp = await router.post("/v1/chat/completions", json={"messages": [], "stream": stream})
    assert resp.status == 502
    body = await resp.json()
    _assert_error(body, 502, "backend_error")
    assert "boom" in body["error"]["message"] and decode.seen == []


async def test_no_healthy_prefill_is_503(prefill, decode):
    prefill.health_status = 503
    router = await start_router([prefill.url], [decode.url], wait=False)
    try:
        resp = await router.post("/v1/completions", json={"prompt": "x"})
        assert resp.status == 503
        body = await resp.json()
        _assert_error(body, 503, "no_healthy_backend")
        assert prefill.seen == []
    finally:
        await router.close()


async def test_non_json_content_type_is_415(router):
    resp = await router.post("/v1/completions", data=b"x", headers={"Content-Type": "text/plain"})
    assert resp.status == 415 and (await resp.json())["error"]["code"] == "unsupported_media_type"
