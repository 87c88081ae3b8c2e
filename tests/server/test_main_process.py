"""The HTTP process as the launcher starts it (`python -m mtpserve.server.main <runtime>/config.json`),
against the fake engine: it serves; on SIGTERM it answers 503 to /health and to new requests while
the stream in flight finishes, then exits 0."""

import asyncio
import dataclasses
import json
import signal
import socket
import subprocess
import sys

import aiohttp
import msgspec

from server_harness import MODEL_NAME, start_fake_engine, wait_healthy
from mtpserve.config import Config


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_http(runtime, model_dir, drain_timeout: float) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    base = Config()
    server = dataclasses.replace(base.server, port=port, served_model_name=MODEL_NAME, drain_timeout=drain_timeout)
    config = dataclasses.replace(base, server=server, engine=dataclasses.replace(base.engine, model=str(model_dir)))
    (runtime / "config.json").write_bytes(msgspec.json.encode(config))
    http = subprocess.Popen([sys.executable, "-m", "mtpserve.server.main", str(runtime / "config.json")])
    return http, f"http://127.0.0.1:{port}"


async def test_serves_then_drains_on_sigterm(tmp_path, model_dir, text_model):
    runtime = tmp_path / "rt"
    engine = start_fake_engine(runtime, text_model.vocab_size, "--step-ms", "10")
    http, base_url = _start_http(runtime, model_dir, drain_timeout=20.0)
    try:
        await _wait_listening(base_url)
        await wait_healthy(base_url)
        body = {"model": MODEL_NAME, "prompt": "import math\n", "max_tokens": 150, "stream": True}
        async with aiohttp.ClientSession() as session:
            async with session.post(base_url + "/v1/completions", json=body) as resp:
                first = await resp.content.readline()
                assert first.startswith(b"data: {")
                http.send_signal(signal.SIGTERM)
                await asyncio.sleep(0.2)
                async with session.get(base_url + "/health") as health:
                    assert health.status == 503 and (await health.json())["reason"] == "draining"
                late = {**body, "stream": False}
                async with session.post(base_url + "/v1/completions", json=late) as refused:
                    assert refused.status == 503
                rest = await resp.content.read()
        events = [line for line in (first + rest).split(b"\n\n") if line]
        assert events[-1] == b"data: [DONE]"
        last = json.loads(events[-2].removeprefix(b"data: "))
        assert last["choices"][0]["finish_reason"] == "length"  # the stream finished, not cut off
        assert await asyncio.to_thread(http.wait, 30) == 0
    finally:
        if http.poll() is None:
            http.kill()
            http.wait()
        engine.stop()


async def test_drain_timeout_ends_streams_with_an_error_event(tmp_path, model_dir, text_model):
    runtime = tmp_path / "rt"
    engine = start_fake_engine(runtime, text_model.vocab_size, "--step-ms", "10")
    http, base_url = _start_http(runtime, model_dir, drain_timeout=0.0)
    try:
        await _wait_listening(base_url)
        await wait_healthy(base_url)
        body = {"model": MODEL_NAME, "prompt": "import math\n", "max_tokens": 450, "stream": True}
        async with aiohttp.ClientSession() as session:
            async with session.post(base_url + "/v1/completions", json=body) as resp:
                first = await resp.content.readline()
                http.send_signal(signal.SIGTERM)
                rest = await resp.content.read()
        events = [line for line in (first + rest).split(b"\n\n") if line]
        assert events[-1] == b"data: [DONE]"
        assert json.loads(events[-2].removeprefix(b"data: "))["error"]["code"] == "shutting_down"
        assert await asyncio.to_thread(http.wait, 30) == 0
    finally:
        if http.poll() is None:
            http.kill()
            http.wait()
        engine.stop()


async def _wait_listening(base_url: str) -> None:
    for _ in range(300):
        try:
            async with aiohttp.ClientSession() as session:
                async with session.get(base_url + "/health"):
                    return
        except aiohttp.ClientConnectionError:
            await asyncio.sleep(0.05)
    raise TimeoutError("HTTP process never listened")
