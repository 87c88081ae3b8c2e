"""An instance that cannot take a request (refused connection, 503) is replaced by another of its role;
one that may have started it (5xx) is not."""

from __future__ import annotations

import contextlib

import pytest

from fake_instance import FakeInstance
from router_harness import DONE, sse_events, start_router, until

BODY = {"prompt": "x", "max_tokens": 4, "seed": 7}


@contextlib.asynccontextmanager
async def fakes(*roles: str):
    started = [FakeInstance(role) for role in roles]
    for fake in started:
        await fake.server.start_server()
    try:
        yield started
    finally:
        for fake in started:
            await fake.server.close()


async def _failovers(router, role: str) -> float:
    text = await (await router.get("/metrics")).text()
    name = f'mtpserve:router_failovers_total{{role="{role}"}}'
    line = next((x for x in text.splitlines() if x.startswith(name)), None)
    return float(line.split()[-1]) if line else 0.0


async def _assert_whole_answer(resp, stream: bool) -> None:
    assert resp.status == 200, await resp.text()
    if stream:
        events = sse_events(await resp.read())
        assert events[-1] == DONE and not any(isinstance(e, dict) and "error" in e for e in events)
        assert sum(len(e["choices"]) for e in events[:-1] if e.get("choices")) >= BODY["max_tokens"]
    else:
        assert (await resp.json())["usage"]["completion_tokens"] == BODY["max_tokens"]


async def _in_flight(router) -> list[int]:
    body = await (await router.get("/health")).json()
    return [b["in_flight"] for b in body["prefill"] + body["decode"]]


@pytest.mark.parametrize("stream", [False, True])
async def test_a_refused_prefill_is_replaced(stream):
    async with fakes("prefill", "prefill", "decode") as (gone, alive, decode):
        router = await start_router([gone.url, alive.url], [decode.url], health_interval=60.0)
        try:
            await gone.server.close()  # the router still believes it healthy
            resp = await router.post("/v1/completions", json={**BODY, "stream": stream})
            await _assert_whole_answer(resp, stream)
            assert len(alive.seen) == 1 and len(decode.seen) == 1
            await until(lambda: alive.releases, what="the release")  # NOTE: sent in the background
            assert alive.releases == [[decode.seen[0].body["kv_transfer_params"]["transfer_id"]]]
            assert await _failovers(router, "prefill") == 1
            health = await (await router.get("/health")).json()
            assert [b["healthy"] for b in health["prefill"]] == [False, True]
            assert await _in_flight(router) == [0, 0, 0]
        finally:
            await router.close()


@pytest.mark.parametrize("stream", [False, True])
async def test_a_draining_decode_is_replaced(stream):
    async with fakes("prefill", "decode", "decode") as (prefill, draining, alive):
        router = await start_router([prefill.url], [draining.url, alive.url])
        try:
            draining.unavailable = True
            resp = await router.post("/v1/completions", json={**BODY, "stream": stream})
            await _assert_whole_answer(resp, stream)
            assert len(draining.seen) == 1 and len(alive.seen) == 1  # tried once, then the other
            kv = alive.seen[0].body["kv_transfer_params"]
            assert draining.seen[0].body["kv_transfer_params"] == kv
            await until(lambda: prefill.releases, what="the release")
            assert prefill.releases == [[kv["transfer_id"]]]  # one release, whoever decoded
            assert await _failovers(router, "decode") == 1
            assert await _in_flight(router) == [0, 0, 0]
        finally:
            await router.close()


async def test_a_5xx_is_not_retried():
    async with fakes("prefill", "prefill", "decode") as (crashing, other, decode):
        router = await start_router([crashing.url, other.url], [decode.url])
        try:
            crashing.crash = True  # first in the idle pool's round-robin order
            resp = await router.post("/v1/completions", json=BODY)
            assert resp.status == 502 and (await resp.json())["error"]["code"] == "backend_error"
            assert len(crashing.seen) == 1 and other.seen == [] and decode.seen == []
            assert await _failovers(router, "prefill") == 0
        finally:
            await router.close()


@pytest.mark.parametrize("stream", [False, True])
async def test_every_instance_refusing_is_503(stream):
    async with fakes("prefill", "prefill", "decode") as (first, second, decode):
        router = await start_router([first.url, second.url], [decode.url], health_interval=60.0)
        try:
            await first.server.close()
            await second.server.close()
            resp = await router.post("/v1/completions", json={**BODY, "stream": stream})
            assert resp.status == 503 and (await resp.json())["error"]["code"] == "backend_unreachable"
            assert await _failovers(router, "prefill") == 1 and decode.seen == []
            assert await _in_flight(router) == [0, 0, 0]
        finally:
            await router.close()
