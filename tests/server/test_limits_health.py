"""Limits and auth (429, API key), health while starting and after engine death, and an error after
the stream started (SSE error event then [DONE])."""

import aiohttp
import pytest

from server_harness import LONG, MODEL_NAME, read_events, start_fake_engine, wait_healthy


@pytest.fixture
def settings(settings):
    import dataclasses
    return dataclasses.replace(settings, server=dataclasses.replace(settings.server, max_concurrent_requests=4,
                                                                    api_key="sekrit"))


async def test_limit_429_and_api_key(fake_server):
    base_url, _ = fake_server
    auth = {"Authorization": "Bearer sekrit"}
    async with aiohttp.ClientSession() as session:
        async with session.post(base_url + "/v1/completions", json={**LONG, "stream": False, "stream_options": None}) as r:
            assert r.status == 401 and (await r.json())["error"]["code"] == "invalid_api_key"
        async with session.get(base_url + "/v1/models", headers={"Authorization": "Bearer sekriT"}) as r:
            assert r.status == 401
        async with session.get(base_url + "/health") as r:
            assert r.status == 200
        held = [await session.post(base_url + "/v1/completions", json=LONG, headers=auth) for _ in range(2)]
        body = {**LONG, "n": 3}
        async with session.post(base_url + "/v1/completions", json=body, headers=auth) as r:
            assert r.status == 429 and (await r.json())["error"]["type"] == "rate_limit_error"
        async with session.post(base_url + "/v1/completions", json={**body, "n": 5}, headers=auth) as r:
            assert r.status == 400 and (await r.json())["error"]["code"] == "too_many_completions"
        body["n"] = 2
        async with session.post(base_url + "/v1/completions", json={**body, "max_tokens": 3}, headers=auth) as r:
            assert r.status == 200
        for resp in held:
            resp.close()
        assert "mtpserve:http_requests_rejected_total" in await (await session.get(base_url + "/metrics",
                                                                                    headers=auth)).text()


async def test_engine_death_mid_stream_is_sse_error_then_done(tmp_path, text_model, settings):
    from aiohttp.test_utils import TestServer
    from server_harness import open_fake_output
    from mtpserve.server.app import make_app
    proc = start_fake_engine(tmp_path / "rt", text_model.vocab_size, "--step-ms", "20")
    server = TestServer(make_app(settings, MODEL_NAME, text_model, tmp_path / "rt", open_fake_output),
                        handler_cancellation=True)
    await server.start_server()
    base_url = str(server.make_url("")).rstrip("/")
    auth = {"Authorization": "Bearer sekrit"}
    try:
        async with aiohttp.ClientSession(headers=auth) as session:
            async with session.get(base_url + "/health") as r:
                assert r.status in (200, 503)
            await wait_healthy(base_url)
            async with session.post(base_url + "/v1/completions", json=LONG) as resp:
                assert resp.status == 200
                await read_events(resp, until_tokens=3)
                proc.kill()
                events, _ = await read_events(resp)
            assert events[-1] is None and events[-2]["error"]["code"] == "engine_dead"
            async with session.get(base_url + "/health") as r:
                assert r.status == 503 and "closed" in (await r.json())["reason"]
            async with session.post(base_url + "/v1/completions", json={**LONG, "stream": False, "stream_options": None}) as r:
                assert r.status == 503
    finally:
        await server.close()
        proc.stop()


async def test_health_503_while_starting(tmp_path, text_model, settings):
    from aiohttp.test_utils import TestServer
    from server_harness import open_fake_output
    from mtpserve.server.app import make_app
    (tmp_path / "rt").mkdir(mode=0o700)
    server = TestServer(make_app(settings, MODEL_NAME, text_model, tmp_path / "rt", open_fake_output))
    await server.start_server()
    try:
        async with aiohttp.ClientSession() as session:
            async with session.get(server.make_url("/health")) as r:
                assert r.status == 503 and (await r.json())["reason"] == "engine starting"
            async with session.post(server.make_url("/v1/completions"), json=LONG,
                                    headers={"Authorization": "Bearer sekrit"}) as r:
                assert r.status == 503
        proc = start_fake_engine(tmp_path / "rt", text_model.vocab_size)
        try:
            await wait_healthy(str(server.make_url("")).rstrip("/"))
        finally:
            proc.stop()
    finally:
        await server.close()




async def test_health_follows_engine_progress(tmp_path, text_model, settings):
    """A stopped engine (SIGSTOP: alive, socket open, no heartbeat) turns /health 503; SIGCONT heals."""
    import asyncio
    import dataclasses
    import os
    import signal
    import time

    from aiohttp.test_utils import TestServer
    from server_harness import open_fake_output
    from mtpserve.server.app import make_app
    fast = dataclasses.replace(settings, server=dataclasses.replace(settings.server, heartbeat_timeout=0.5))
    proc = start_fake_engine(tmp_path / "rt", text_model.vocab_size)
    server = TestServer(make_app(fast, MODEL_NAME, text_model, tmp_path / "rt", open_fake_output))
    await server.start_server()
    base_url = str(server.make_url("")).rstrip("/")
    try:
        await wait_healthy(base_url)
        os.kill(proc.proc.pid, signal.SIGSTOP)
        try:
            async with aiohttp.ClientSession() as session:
                deadline = time.monotonic() + 5
                while (r := await session.get(base_url + "/health")).status == 200:
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.1)
                assert r.status == 503 and "heartbeat" in (await r.json())["reason"]
        finally:
            os.kill(proc.proc.pid, signal.SIGCONT)
        await wait_healthy(base_url, timeout_s=5)
    finally:
        await server.close()
        proc.stop()
