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
