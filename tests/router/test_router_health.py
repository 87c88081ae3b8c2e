"""The router's /health follows its backends; /v1/models, /metrics; the API key; where requests go."""

from __future__ import annotations

import asyncio

import pytest

from fake_instance import FakeInstance
from router_harness import start_router, until

BODY = {"prompt": "x", "max_tokens": 4, "stream": True}


async def _status(router) -> int:
    resp = await router.get("/health")
    await resp.read()
    return resp.status


async def test_health_follows_backends(router, prefill, decode):
    body = await (await router.get("/health")).json()
    assert body["status"] == "ok"
    assert body["decode"] == [{"url": decode.url, "healthy": True, "in_flight": 0, "last_error": None,
                              "prefixes": 0, "prefix_cache_hit_rate": None}]
    decode.health_status = 503
    await until(lambda: _down(router), what="router /health 503")
    body = await (await router.get("/health")).json()
    assert body["error"]["code"] == "no_healthy_backend" and "decode" in body["error"]["message"]
    assert body["decode"][0]["last_error"].startswith("/health answered 503")
    assert (await router.post("/v1/completions", json=BODY)).status == 503
    decode.health_status = 200
    await until(lambda: _up(router), what="router /health 200 again")


async def _down(router) -> bool:
    return await _status(router) == 503


async def _up(router) -> bool:
    return await _status(router) == 200


async def test_models_come_from_a_decode_instance(router):
    body = await (await router.get("/v1/models")).json()
    assert body["data"][0]["owned_by"] == "decode"


async def test_metrics_count_outcomes(router, prefill, decode):
    await (await router.post("/v1/completions", json=BODY)).read()
    prefill.reject = True
    await (await router.post("/v1/completions", json=BODY)).read()
    text = (await (await router.get("/metrics")).read()).decode()
    assert 'mtpserve:router_requests_total{outcome="completed",route="completions"} 1.0' in text
    assert 'mtpserve:router_requests_total{outcome="client_error",route="completions"} 1.0' in text
    assert "mtpserve:router_time_to_first_token_seconds_count 1.0" in text
    assert f'mtpserve:router_backend_healthy{{role="decode",url="{decode.url}"}} 1.0' in text


@pytest.mark.parametrize("router_options", [{"api_key": "secret"}])
async def test_api_key(router, prefill, decode):
    assert (await router.post("/v1/completions", json=BODY)).status == 401
    assert (await router.get("/health")).status == 200
    resp = await router.post("/v1/completions", json=BODY, headers={"Authorization": "Bearer secret"})
    await resp.read()
    assert resp.status == 200 and prefill.seen[0].authorization == "Bearer secret"


async def test_requests_go_to_the_least_loaded_decode(prefill):
    busy, idle = FakeInstance("decode"), FakeInstance("decode")
    for fake in (busy, idle):
        await fake.server.start_server()
    router = await start_router([prefill.url], [busy.url, idle.url])
    try:
        busy.hang_after = idle.hang_after = 1  # each keeps its request open
        first = await router.post("/v1/completions", json=BODY)
        await until(lambda: busy.seen or idle.seen, what="first decode call")
        loaded, other = (busy, idle) if busy.seen else (idle, busy)
        second = await router.post("/v1/completions", json=BODY)
        await until(lambda: other.seen, what="second request on the other decode")
        assert len(loaded.seen) == 1
        body = await (await router.get("/health")).json()
        assert sorted(d["in_flight"] for d in body["decode"]) == [1, 1]
        first.close()
        second.close()
        await asyncio.wait_for(asyncio.gather(busy.cancelled.wait(), idle.cancelled.wait()), 5)
    finally:
        await router.close()
        for fake in (busy, idle):
            await fake.server.close()
