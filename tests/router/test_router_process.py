"""The router as a user runs it: its own process (uvloop), serving, then stopped by SIGTERM."""

from __future__ import annotations

import asyncio
import signal
import socket
import sys

import aiohttp

from router_harness import DONE, sse_events, until


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def test_process_serves_and_stops_on_sigterm(prefill, decode):
    port = _free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "mtpserve.router.main", "--prefill", prefill.url, "--decode", decode.url,
        "--port", str(port), "--health-interval", "0.1", "--log-format", "json",
        stdout=asyncio.subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as session:
            async def healthy() -> bool:
                try:
                    async with session.get(base + "/health") as resp:
                        return resp.status == 200
                except aiohttp.ClientConnectionError:
                    return False

            await until(healthy, timeout=30, what="router process healthy")
            async with session.post(base + "/v1/completions", json={"prompt": "x", "stream": True}) as resp:
                events = sse_events(await resp.read())
        assert events[-1] == DONE and len(decode.seen) == 1
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 15) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
