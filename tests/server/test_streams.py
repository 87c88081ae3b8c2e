"""Concurrency, client disconnects (streaming and not), limits, auth, health, errors after the stream
started, and the metrics that show the engine returning to idle."""

import asyncio
import time

import aiohttp
import pytest

from server_harness import LONG, MODEL_NAME, gauge, metrics, read_events

@pytest.fixture
def engine_args():
    return ["--step-ms", "20", "--max-model-len", "2048"]


async def _open_stream(session, base_url):
    return await session.post(base_url + "/v1/completions", json=LONG)


async def test_64_streams_close_32_mid_stream(fake_server, no_loop_blocking):
    base_url, _ = fake_server
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        responses = await asyncio.gather(*(_open_stream(session, base_url) for _ in range(64)))
        assert all(r.status == 200 for r in responses)
        firsts = await asyncio.gather(*(read_events(r, until_tokens=3) for r in responses))
        assert gauge(await metrics(session, base_url), "vllm:num_requests_running") == 64
        for resp in responses[:32]:
            resp.close()
        t0 = time.monotonic()
        while True:
            text = await metrics(session, base_url)
            if gauge(text, "vllm:num_requests_running") == 32:
                break
            assert time.monotonic() - t0 < 1.0, "aborts did not reach the engine within 1 s"
            await asyncio.sleep(0.02)
        print(f"32 aborts visible in engine stats after {time.monotonic() - t0:.3f}s")
        results = await asyncio.gather(*(read_events(r) for r in responses[32:]))
        for (events, tokens), (_, first_tokens) in zip(results, firsts[32:]):
            assert events[-1] is None
            usage = events[-2]["usage"]
            assert usage["completion_tokens"] == first_tokens + tokens == 400
        t0 = time.monotonic()
        while gauge(text := await metrics(session, base_url), "vllm:num_requests_running") != 0:
            assert time.monotonic() - t0 < 1.0
            await asyncio.sleep(0.02)
        assert gauge(text, "mtpserve:kv_blocks_used") == 0 and gauge(text, "vllm:kv_cache_usage_perc") == 0
        assert gauge(text, "mtpserve:http_requests_active") == 0
        assert 'vllm:request_success_total{finished_reason="abort",model_name="tiny-test"} 32.0' in text
        assert 'vllm:request_success_total{finished_reason="length",model_name="tiny-test"} 32.0' in text


async def test_non_streaming_disconnect_aborts(fake_server):
    base_url, _ = fake_server
    body = {**LONG, "stream": False, "stream_options": None, "max_tokens": 1500}
    async with aiohttp.ClientSession() as session:
        task = asyncio.create_task(session.post(base_url + "/v1/completions", json=body))
        t0 = time.monotonic()
        while gauge(await metrics(session, base_url), "vllm:num_requests_running") != 1:
            assert time.monotonic() - t0 < 5
            await asyncio.sleep(0.02)
        task.cancel()
        t0 = time.monotonic()
        while gauge(text := await metrics(session, base_url), "vllm:num_requests_running") != 0:
            assert time.monotonic() - t0 < 1.0, "non-streaming disconnect did not abort"
            await asyncio.sleep(0.02)
        assert 'finished_reason="abort"' in text


async def test_metrics_names(fake_server):
    base_url, _ = fake_server
    async with aiohttp.ClientSession() as session:
        async with session.post(base_url + "/v1/completions", json={**LONG, "stream": False, "stream_options": None, "max_tokens": 30}) as r:
            assert r.status == 200
        await asyncio.sleep(0.2)  # one stats period
        text = await metrics(session, base_url)
    for name in ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                 "vllm:spec_decode_num_accepted_tokens_total", "vllm:spec_decode_num_accepted_tokens_per_pos_total",
                 "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
                 "vllm:e2e_request_latency_seconds_bucket", "vllm:num_requests_running",
                 "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total"):
        assert name in text, name
    assert gauge(text, "vllm:generation_tokens_total") == 30
    assert gauge(text, "vllm:spec_decode_num_drafts_total") > 0


async def test_stop_string_aborts_the_engine_request(fake_server, text_model):
    base_url, _ = fake_server
    prompt = "value = compute(value)\nresult = value\n"
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 1500, "stop": ["result"]}
    async with aiohttp.ClientSession() as session:
        async with session.post(base_url + "/v1/completions", json=body) as r:
            out = await r.json()
        assert out["choices"][0]["finish_reason"] == "stop" and out["usage"]["completion_tokens"] < 40
        t0 = time.monotonic()
        while gauge(await metrics(session, base_url), "vllm:num_requests_running") != 0:
            assert time.monotonic() - t0 < 1.0, "the engine kept generating after the stop string"
            await asyncio.sleep(0.02)
