"""The router as a user runs it: its own process (uvloop), serving, then stopped by SIGTERM."""

from __future__ import annotations

import asyncio
import signal
import socket
import sys

import aiohttp
import pytest

from router_harness import DONE, sse_events, until


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def _start(prefill, decode, *flags: str) -> tuple[asyncio.subprocess.Process, str]:
    port = _free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "mtpserve.router.main", "--prefill", prefill.url, "--decode", decode.url,
        "--port", str(port), "--health-interval", "0.1", "--log-format", "json", *flags,
        stdout=asyncio.subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"

    async def healthy() -> bool:
        try:
            async with aiohttp.ClientSession() as session, session.get(base + "/health") as resp:
                return resp.status == 200
        except aiohttp.ClientConnectionError:
            return False

    try:
        await until(healthy, timeout=30, what="router process healthy")
    except BaseException:
        proc.kill()
        await proc.wait()
        raise
    return proc, base


async def _stop(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        proc.kill()
        await proc.wait()


async def test_process_serves_and_stops_on_sigterm(prefill, decode):
    proc, base = await _start(prefill, decode)
    try:
        async with aiohttp.ClientSession() as session:
            async with session.post(base + "/v1/completions", json={"prompt": "x", "stream": True}) as resp:
                events = sse_events(await resp.read())
        assert events[-1] == DONE and len(decode.seen) == 1
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 15) == 0
    finally:
        await _stop(proc)


async def test_sigterm_drains_streams_in_flight_and_takes_no_new_ones(prefill, decode):
    decode.event_delay = 0.25  # a stream of 8 tokens lasts about 2 s
    proc, base = await _start(prefill, decode, "--drain-timeout", "10")
    try:
        async with aiohttp.ClientSession() as session:
            async with session.post(base + "/v1/completions",
                                    json={"prompt": "x", "max_tokens": 8, "stream": True}) as resp:
                first = await resp.content.readuntil(b"\n\n")  # the prefill's first token
                await until(lambda: decode.seen, what="the decode call")
                proc.send_signal(signal.SIGTERM)
                await asyncio.sleep(0.3)
                with pytest.raises(aiohttp.ClientConnectionError):  # no longer listening
                    async with aiohttp.ClientSession() as fresh:
                        await fresh.post(base + "/v1/completions", json={"prompt": "x"})
                events = sse_events(first + await resp.read())
        assert events[-1] == DONE and not any("error" in e for e in events[:-1])
        assert sum(len(e["choices"]) for e in events[:-1] if e.get("choices")) >= 8
        assert await asyncio.wait_for(proc.wait(), 15) == 0
    finally:
        await _stop(proc)


async def _stream_until_decoding(session, base: str, decode) -> tuple[aiohttp.ClientResponse, bytes]:
    resp = await session.post(base + "/v1/completions", json={"prompt": "x", "max_tokens": 20, "stream": True})
    first = await resp.content.readuntil(b"\n\n")
    await until(lambda: decode.seen, what="the decode call")
    return resp, first


def _assert_cut(events: list) -> None:
    assert events[-1] == DONE and events[-2]["error"]["code"] == "shutting_down"


@pytest.mark.parametrize("drain, second_signal", [("0.5", False), ("60", True)])
async def test_streams_still_running_when_the_drain_ends_get_an_error_event(prefill, decode, drain,
                                                                           second_signal):
    decode.event_delay = 1.0  # 20 tokens: far longer than a 0.5 s drain
    proc, base = await _start(prefill, decode, "--drain-timeout", drain)
    try:
        async with aiohttp.ClientSession() as session:
            resp, first = await _stream_until_decoding(session, base, decode)
            proc.send_signal(signal.SIGTERM)
            if second_signal:  # the 60 s drain ends at once on a second SIGTERM
                await asyncio.sleep(0.5)
                assert proc.returncode is None
                proc.send_signal(signal.SIGTERM)
            events = sse_events(first + await asyncio.wait_for(resp.read(), 5))
        _assert_cut(events)
        await asyncio.wait_for(decode.cancelled.wait(), 5)  # the decode call was closed: it aborts
        assert await asyncio.wait_for(proc.wait(), 5) == 0
    finally:
        await _stop(proc)


async def test_a_json_request_cut_by_the_drain_gets_503(prefill, decode):
    decode.event_delay = 1.0
    proc, base = await _start(prefill, decode, "--drain-timeout", "0.5")
    try:
        async with aiohttp.ClientSession() as session:
            call = asyncio.ensure_future(session.post(base + "/v1/completions",
                                                      json={"prompt": "x", "max_tokens": 20}))
            await until(lambda: decode.seen, what="the decode call")
            proc.send_signal(signal.SIGTERM)
            resp = await asyncio.wait_for(call, 10)
            assert resp.status == 503 and (await resp.json())["error"]["code"] == "shutting_down"
        assert await asyncio.wait_for(proc.wait(), 10) == 0
    finally:
        await _stop(proc)
