"""The router in front of mixed instances (fake ones at their HTTP boundary): whole answers relayed, the
policies' choices, an instance that dies mid-run, and instances added or removed at run time (admin
route and SIGHUP)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys

import aiohttp
import pytest

from fake_instance import FakeInstance
from router_harness import DONE, sse_events, start_router, until

BODY = {"max_tokens": 4, "seed": 7}
PREFIXES = [f"system prompt {i}: " + "you are a careful assistant. " * 8 for i in range(4)]


@contextlib.asynccontextmanager
async def mixed_fakes(num: int):
    fakes = [FakeInstance("mixed") for _ in range(num)]
    for fake in fakes:
        await fake.server.start_server()
    try:
        yield fakes
    finally:
        for fake in fakes:
            await fake.server.close()


async def mixed_router(fakes: list[FakeInstance], **options):
    return await start_router([], [], instance_urls=tuple(f.url for f in fakes), **options)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_mixed_instance_answers_the_whole_request(stream):
    async with mixed_fakes(1) as (fake,):
        router = await mixed_router([fake])
        try:
            body = {**BODY, "prompt": "hello", "stream": stream, "n": 2}  # NOTE: n > 1 is fine without PD
            resp = await router.post("/v1/completions", json=body)
            assert resp.status == 200, await resp.text()
            async with aiohttp.ClientSession() as session, session.post(fake.url + "/v1/completions",
                                                                       json=body) as direct:
                want = await direct.read()
            got = await resp.read()
            if stream:
                assert sse_events(got) == sse_events(want) and sse_events(got)[-1] == DONE
            else:
                assert got == want
            assert fake.seen[0].stage is None  # no PD stage header for a mixed instance
        finally:
            await router.close()


async def served_by(router, fakes: list[FakeInstance], prompt: str) -> int:
    counts = [len(f.seen) for f in fakes]
    resp = await router.post("/v1/completions", json={**BODY, "prompt": prompt})
    assert resp.status == 200, await resp.text()
    await resp.read()
    return next(i for i, f in enumerate(fakes) if len(f.seen) > counts[i])


async def test_cache_aware_sends_a_prefix_back_where_it_went_and_spreads_new_ones():
    async with mixed_fakes(2) as fakes:
        router = await mixed_router(fakes)
        try:
            first = [await served_by(router, fakes, p + "question 0") for p in PREFIXES]
            assert sorted(first) == [0, 0, 1, 1], "misses spread over the instances"
            for turn in range(1, 4):
                again = [await served_by(router, fakes, p + f"question {turn}") for p in PREFIXES]
                assert again == first, "a known prefix goes back to its instance"
            text = await (await router.get("/metrics")).text()
            assert 'mtpserve:router_policy_decisions_total{reason="cache",role="mixed"} 12.0' in text
        finally:
            await router.close()


async def test_round_robin_alternates_whatever_the_prefix():
    async with mixed_fakes(2) as fakes:
        router = await mixed_router(fakes, policy="round_robin")
        try:
            assert [await served_by(router, fakes, PREFIXES[0] + str(i)) for i in range(4)] == [0, 1, 0, 1]
        finally:
            await router.close()


async def test_an_overloaded_instance_gives_way_to_the_least_loaded():
    async with mixed_fakes(2) as fakes:
        router = await mixed_router(fakes, balance_abs_threshold=1, balance_rel_threshold=1.0)
        try:
            home = await served_by(router, fakes, PREFIXES[0] + "a")
            fakes[home].event_delay = 0.3
            streams = [asyncio.ensure_future(router.post("/v1/completions", json={
                **BODY, "prompt": PREFIXES[0] + f"b{i}", "stream": True})) for i in range(3)]
            responses = await asyncio.gather(*streams)
            for resp in responses:
                assert resp.status == 200
                await resp.read()
            assert len(fakes[1 - home].seen) >= 1, "past the thresholds the other instance took some"
        finally:
            await router.close()


async def test_an_instance_dying_mid_run_ends_its_streams_in_band_and_the_rest_carry_on():
    async with mixed_fakes(2) as fakes:
        router = await mixed_router(fakes, policy="least_loaded", health_interval=60.0)
        try:
            dying, alive = fakes
            dying.die_after, dying.event_delay, alive.event_delay = 2, 0.05, 0.05
            streams = [asyncio.ensure_future(router.post("/v1/completions", json={
                **BODY, "prompt": f"p{i}", "stream": True, "max_tokens": 6})) for i in range(4)]
            events = [sse_events(await (await s).read()) for s in streams]
            failed = [e for e in events if any(isinstance(x, dict) and "error" in x for x in e)]
            assert len(failed) == len(dying.seen) == 2 and all(e[-1] == DONE for e in events)
            await dying.server.close()  # the process is gone; the router still believes it healthy
            for i in range(6):
                resp = await router.post("/v1/completions", json={**BODY, "prompt": f"q{i}", "stream": i % 2 == 0})
                assert resp.status == 200, "no 5xx while a healthy instance remains"
                await resp.read()
            assert len(alive.seen) == 2 + 6
        finally:
            await router.close()


@pytest.mark.parametrize("stream", [False, True])
async def test_an_instance_dying_before_it_answers_is_replaced(stream):
    """Nothing reached the client and the request died with the instance: another one runs it whole."""
    async with mixed_fakes(2) as fakes:
        router = await mixed_router(fakes, policy="round_robin", health_interval=60.0)
        try:
            fakes[0].die_before_answer = True
            for i in range(4):
                resp = await router.post("/v1/completions", json={**BODY, "prompt": f"p{i}", "stream": stream})
                assert resp.status == 200, await resp.text()
                if stream:
                    events = sse_events(await resp.read())
                    assert events[-1] == DONE and not any(isinstance(e, dict) and "error" in e for e in events)
                else:
                    assert (await resp.json())["usage"]["completion_tokens"] == BODY["max_tokens"]
            assert len(fakes[1].seen) == 4
        finally:
            await router.close()


async def test_instances_added_and_removed_at_run_time():
    async with mixed_fakes(2) as (first, second):
        router = await mixed_router([first], policy="round_robin")
        try:
            resp = await router.post("/admin/instances", json={"instance": [first.url, second.url]})
            assert resp.status == 200 and (await resp.json())["instance"] == [first.url, second.url]
            await until(lambda: health_of(router, second.url), what="the new instance healthy")
            served = [await served_by(router, [first, second], f"x{i}") for i in range(4)]
            assert set(served) == {0, 1}
            resp = await router.post("/admin/instances", json={"instance": [second.url]})
            assert resp.status == 200
            assert {await served_by(router, [first, second], f"y{i}") for i in range(3)} == {1}
            bad = await router.post("/admin/instances", json={"instance": [first.url], "prefill": [second.url]})
            assert bad.status == 400 and (await bad.json())["error"]["code"] == "invalid_instances"
            assert (await (await router.get("/admin/instances")).json())["instance"] == [second.url]
        finally:
            await router.close()


async def health_of(router, url: str) -> bool:
    body = await (await router.get("/health")).json()
    return any(b["url"] == url and b["healthy"] for b in body.get("instances", []))


async def test_sighup_rereads_the_instances_file(tmp_path):
    async with mixed_fakes(2) as (first, second):
        listing = tmp_path / "instances"
        listing.write_text(f"# mixed instances\n{first.url}\n")
        port = free_port()
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "mtpserve.router.main", "--instances-file", str(listing), "--port", str(port),
            "--health-interval", "0.1", "--log-format", "json", stdout=asyncio.subprocess.DEVNULL)
        base = f"http://127.0.0.1:{port}"
        try:
            async with aiohttp.ClientSession() as session:
                async def members() -> list[str]:
                    with contextlib.suppress(aiohttp.ClientConnectionError):
                        async with session.get(base + "/admin/instances") as resp:
                            return (await resp.json())["instance"]
                    return []

                await until(lambda: _equals(members(), [first.url]), timeout=30, what="router up")
                listing.write_text(f"{first.url}\n{second.url}  # added\n")
                proc.send_signal(signal.SIGHUP)
                await until(lambda: _equals(members(), [first.url, second.url]), what="the file re-read")
                listing.write_text("prefill http://nowhere:1\n")  # impossible: kept as it was
                proc.send_signal(signal.SIGHUP)
                await asyncio.sleep(0.3)
                assert await members() == [first.url, second.url]
        finally:
            proc.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(proc.wait(), 15) == 0


async def _equals(value, want) -> bool:
    return await value == want


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
