"""Prefix caching on the HTTP side (docs/prefix-caching.md): `usage.prompt_tokens_details.cached_tokens`
from the engine's PrefixHits in every usage object, the prefix-cache metrics from its EngineStats, and
`POST /reset_prefix_cache` behind the API key (mixed, prefill and decode instances).

The fake engine caches the full prompt blocks (16 tokens) of every request once its prefill ran; a
later prompt hits its longest cached run of full blocks short of its last token.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import time

import aiohttp
import pytest
from aiohttp.test_utils import TestServer
from openai import AsyncOpenAI

from fake_engine import BLOCK_SIZE
from mtpserve.ipc.request_channel import EngineStats, ResetPrefixCache
from mtpserve.server import routes_misc
from mtpserve.server.app import make_app
from mtpserve.server.metrics import ServerMetrics
from pd_harness import pd_instance, until
from server_harness import MODEL_NAME, metrics, open_fake_output, read_events, start_fake_engine, wait_healthy
from test_metrics_export import counter

KEY = "sekrit"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT_IDS = list(range(1, 41))  # 40 tokens: two full blocks can be cached, the third holds the last token
OTHER_IDS = list(range(101, 125))  # 24 tokens: one full block
SYSTEM = "You are a careful reviewer of Python code. " * 4
USER = "Is `x = [i * i for i in range(10)]` idiomatic?"
CHAT = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}]


@pytest.fixture
def settings(settings):
    return dataclasses.replace(settings, server=dataclasses.replace(settings.server, api_key=KEY))


def expected_hit(num_prompt_tokens: int) -> int:
    """Full blocks short of the prompt's last token (the fake engine's rule, and the real one's)."""
    return (num_prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE


def cached(usage: dict) -> int:
    return usage["prompt_tokens_details"]["cached_tokens"]


async def complete(session: aiohttp.ClientSession, base_url: str, **body) -> dict:
    async with session.post(base_url + "/v1/completions", json={"model": MODEL_NAME, "max_tokens": 4, **body}) as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def stream_usages(session: aiohttp.ClientSession, base_url: str, path: str, **body) -> list[dict | None]:
    """The `usage` of every chunk of a streamed answer with continuous usage stats (the last: the total)."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    body = {"model": MODEL_NAME, "max_tokens": 6, "stream": True, "stream_options": options, **body}
    async with session.post(base_url + path, json=body) as r:
        assert r.status == 200, await r.text()
        events, _ = await read_events(r)
    assert events[-1] is None
    return [e["usage"] for e in events[:-1]]


async def test_cached_tokens_come_from_prefix_hits(fake_server):
    base_url, _ = fake_server
    async with aiohttp.ClientSession(headers=AUTH) as session:
        first = await complete(session, base_url, prompt=PROMPT_IDS)
        assert first["usage"]["prompt_tokens"] == 40 and cached(first["usage"]) == 0
        again = await complete(session, base_url, prompt=PROMPT_IDS)
        assert cached(again["usage"]) == expected_hit(40) == 32
        longer = await complete(session, base_url, prompt=PROMPT_IDS[:20] + [7] * 30)
        assert cached(longer["usage"]) == 16  # the shared first block only


async def test_cached_tokens_in_streamed_usage(fake_server):
    base_url, _ = fake_server
    async with aiohttp.ClientSession(headers=AUTH) as session:
        await complete(session, base_url, prompt=PROMPT_IDS)
        usages = await stream_usages(session, base_url, "/v1/completions", prompt=PROMPT_IDS)
        # NOTE: the hit is reported at admission, before the request's first frame
        assert usages and all(u is not None and cached(u) == 32 for u in usages)


async def test_cached_tokens_in_chat_usage(fake_server):
    base_url, _ = fake_server
    async with aiohttp.ClientSession(headers=AUTH) as session:
        async with session.post(base_url + "/v1/chat/completions",
                                json={"model": MODEL_NAME, "messages": CHAT, "max_tokens": 4}) as r:
            first = (await r.json())["usage"]
        assert cached(first) == 0
        usages = await stream_usages(session, base_url, "/v1/chat/completions", messages=CHAT)
    total = usages[-1]
    assert total is not None and cached(total) == expected_hit(first["prompt_tokens"]) > 0


async def test_the_openai_client_reads_cached_tokens(fake_server):
    base_url, _ = fake_server
    async with AsyncOpenAI(base_url=base_url + "/v1", api_key=KEY, max_retries=0) as client:
        await client.completions.create(model=MODEL_NAME, prompt=PROMPT_IDS, max_tokens=3)
        out = await client.completions.create(model=MODEL_NAME, prompt=PROMPT_IDS, max_tokens=3)
        chat = await client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}],
            max_tokens=3)
    assert out.usage is not None and out.usage.prompt_tokens_details is not None
    assert out.usage.prompt_tokens_details.cached_tokens == 32
    assert chat.usage is not None and chat.usage.prompt_tokens_details is not None
    assert chat.usage.prompt_tokens_details.cached_tokens == 0


async def test_n_samples_count_a_prompt_once(fake_server):
    """n samples are n engine requests, each reporting its hit; usage counts each prompt once, as
    prompt_tokens does, so cached_tokens never exceeds prompt_tokens."""
    base_url, _ = fake_server
    async with aiohttp.ClientSession(headers=AUTH) as session:
        both = await complete(session, base_url, prompt=[PROMPT_IDS, OTHER_IDS], n=3)
        assert cached(both["usage"]) == 0  # admitted together: none of the six found anything
        again = await complete(session, base_url, prompt=[PROMPT_IDS, OTHER_IDS], n=3)
        assert again["usage"]["prompt_tokens"] == 40 + 24
        assert cached(again["usage"]) == 32 + 16
        mixed = await complete(session, base_url, prompt=[PROMPT_IDS, list(range(300, 340))], n=2)
        assert cached(mixed["usage"]) == 32


async def test_prefix_cache_metrics_follow_the_engine(fake_server):
    base_url, _ = fake_server
    async with aiohttp.ClientSession(headers=AUTH) as session:
        for _ in range(3):
            await complete(session, base_url, prompt=PROMPT_IDS)
        await complete(session, base_url, prompt=OTHER_IDS)
        text = ""
        for _ in range(100):  # NOTE: the fake engine's heartbeat comes every 50 ms
            text = await metrics(session, base_url)
            # NOTE: and the last request finished there (a heartbeat may come between its admission
            # and its end, when its block is still held)
            if (counter(text, "vllm:prefix_cache_queries_total") == 3 * 40 + 24
                    and counter(text, "mtpserve:prefix_cache_evictable_blocks") == 3):
                break
            await asyncio.sleep(0.02)
    assert counter(text, "vllm:prefix_cache_queries_total") == 3 * 40 + 24
    assert counter(text, "vllm:prefix_cache_hits_total") == 2 * 32
    assert counter(text, "mtpserve:prefix_cache_blocks") == 2 + 1
    assert counter(text, "mtpserve:prefix_cache_evictable_blocks") == 3  # idle: no request holds them


def test_exported_names_and_values_from_engine_stats():
    def stats(**kw) -> EngineStats:
        return EngineStats(step_id=1, num_running=2, num_waiting=0, num_kv_blocks_used=25,
                           num_kv_blocks_total=100, **kw)

    m = ServerMetrics(MODEL_NAME)
    m.observe_engine_stats(stats(prefix_cache_queries=500, prefix_cache_hits=320, num_kv_blocks_cached=40,
                                 num_kv_blocks_evictable=30))
    m.observe_engine_stats(stats(prefix_cache_queries=700, prefix_cache_hits=352, num_kv_blocks_cached=12,
                                 num_kv_blocks_evictable=2))
    text = m.render().decode()
    names = {line.split("{")[0] for line in text.splitlines() if "prefix_cache" in line and not line.startswith("#")}
    assert {n for n in names if not n.endswith("_created")} == {
        "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "mtpserve:prefix_cache_blocks",
        "mtpserve:prefix_cache_evictable_blocks"}
    assert counter(text, "vllm:prefix_cache_queries_total") == 700
    assert counter(text, "vllm:prefix_cache_hits_total") == 352
    assert counter(text, "mtpserve:prefix_cache_blocks") == 12
    assert counter(text, "mtpserve:prefix_cache_evictable_blocks") == 2
    # NOTE: the engine counts evictable cached blocks as free: usage is blocks held by requests
    assert counter(text, "vllm:kv_cache_usage_perc") == 0.25


async def test_reset_needs_the_key_and_forgets_the_cache(fake_server):
    base_url, _ = fake_server
    async with aiohttp.ClientSession(headers=AUTH) as session:
        await complete(session, base_url, prompt=PROMPT_IDS)
        await complete(session, base_url, prompt=OTHER_IDS)
        async with aiohttp.ClientSession() as anonymous:
            async with anonymous.post(base_url + "/reset_prefix_cache", json={}) as r:
                assert r.status == 401 and (await r.json())["error"]["code"] == "invalid_api_key"
        assert cached((await complete(session, base_url, prompt=PROMPT_IDS))["usage"]) == 32  # still cached
        async with session.post(base_url + "/reset_prefix_cache", json={}) as r:
            assert r.status == 200 and await r.json() == {"num_blocks": 3}
        assert cached((await complete(session, base_url, prompt=PROMPT_IDS))["usage"]) == 0
        async with session.post(base_url + "/reset_prefix_cache", json={}) as r:
            assert r.status == 200 and await r.json() == {"num_blocks": 2}


async def test_reset_answers_503_when_the_engine_does_not(tmp_path, text_model, settings, monkeypatch):
    """A stopped engine (SIGSTOP) answers nothing: 503 in OpenAI's shape; its late answer is ignored.
    A dead one is not waited for."""
    proc = start_fake_engine(tmp_path / "rt", text_model.vocab_size)
    server = TestServer(make_app(settings, MODEL_NAME, text_model, tmp_path / "rt", open_fake_output))
    await server.start_server()
    base_url = str(server.make_url("")).rstrip("/")
    monkeypatch.setattr(routes_misc, "RESET_TIMEOUT_S", 0.3)
    try:
        await wait_healthy(base_url)
        async with aiohttp.ClientSession(headers=AUTH) as session:
            await complete(session, base_url, prompt=PROMPT_IDS)
            os.kill(proc.proc.pid, signal.SIGSTOP)
            try:
                async with session.post(base_url + "/reset_prefix_cache", json={}) as r:
                    status, body = r.status, await r.json()
            finally:
                os.kill(proc.proc.pid, signal.SIGCONT)
            assert status == 503 and body["error"]["type"] == "service_unavailable_error"
            assert body["error"]["code"] == "engine_unavailable" and "0.3 s" in body["error"]["message"]
            monkeypatch.setattr(routes_misc, "RESET_TIMEOUT_S", 10.0)
            async with session.post(base_url + "/reset_prefix_cache", json={}) as r:
                # NOTE: the first reset ran once the engine woke; its answer found nobody waiting
                assert r.status == 200 and await r.json() == {"num_blocks": 0}
            proc.kill()
            deadline = time.monotonic() + 5
            while (await session.get(base_url + "/health")).status == 200:
                assert time.monotonic() < deadline, "the killed engine still looks healthy"
                await asyncio.sleep(0.02)
            t0 = time.monotonic()
            async with session.post(base_url + "/reset_prefix_cache", json={}) as r:
                assert r.status == 503 and (await r.json())["error"]["code"] == "engine_unavailable"
            assert time.monotonic() - t0 < 1.0  # a dead engine is not waited for
    finally:
        await server.close()
        proc.stop()


@pytest.mark.parametrize("role", ["prefill", "decode"])
async def test_a_pd_instance_serves_reset(tmp_path, text_model, role):
    async with pd_instance(tmp_path, text_model, role, api_key=KEY) as inst:
        async with aiohttp.ClientSession() as session:
            async with session.post(inst.url + "/reset_prefix_cache", json={}) as r:
                assert r.status == 401
            async with session.post(inst.url + "/reset_prefix_cache", json={}, headers=AUTH) as r:
                assert r.status == 200 and await r.json() == {"num_blocks": 0}
        await until(lambda: any(isinstance(m, ResetPrefixCache) for m in inst.engine.received))
