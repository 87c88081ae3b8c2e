"""`python -m mtpserve.router.bench`: what the PD router itself costs, against synthetic backends.

1. start one synthetic instance in this process (prefill: one token plus `kv_transfer_params`;
   decode: the rest, two tokens per write every `--step-ms`; no stage header: the whole answer),
2. start the router as its own process in front of it,
3. send `--requests` streamed requests (`--concurrency` in flight) straight to the instance, then the
   same through the router,
4. print and write (`--out`) time to first token and end-to-end latency percentiles for both, and the
   router process's CPU time per request and per relayed event (Linux /proc).
For real PD figures point `mtpserve bench serve --base-url` at a router in front of real instances.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import aiohttp
from aiohttp import web

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    _options(subparsers.add_parser("router", help="the PD router's own latency and CPU cost"))


def _options(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--tokens", type=int, default=64, help="tokens per answer")
    p.add_argument("--step-ms", type=float, default=10.0, help="the synthetic decode's time per write")
    p.add_argument("--out", type=Path, default=Path("router-bench.json"))
    p.set_defaults(func=run)
    return p


def _event(obj: object) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def _chunk(i: int) -> dict:
    return {"id": "cmpl-bench", "object": "text_completion", "created": 0, "model": "bench",
            "choices": [{"index": 0, "text": f" t{i}", "logprobs": None, "finish_reason": None}]}


def synthetic_instance(tokens: int, step_s: float) -> web.Application:
    async def generate(request: web.Request) -> web.StreamResponse:
        await request.read()
        stage = request.headers.get("X-PD-Stage")
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await asyncio.sleep(step_s)  # NOTE: the prefill step, or the decode's KV read plus first step
        if stage == "prefill":
            await response.write(_event(_chunk(0)) + _event({"kv_transfer_params": {"transfer_id": 1}}))
            return response
        first = 1 if stage == "decode" else 0
        for i in range(first, tokens, 2):
            await response.write(b"".join(_event(_chunk(j)) for j in range(i, min(i + 2, tokens))))
            await asyncio.sleep(step_s)
        await response.write(b"data: [DONE]\n\n")
        return response

    async def ok(request: web.Request) -> web.Response:
        return web.json_response({})

    app = web.Application()
    app.router.add_post("/v1/completions", generate)
    app.router.add_post("/v1/pd/release", ok)
    app.router.add_get("/health", ok)
    return app


async def one_request(session: aiohttp.ClientSession, url: str) -> tuple[float, float, int]:
    """(time to first event, end to end, events) of one streamed request."""
    start = time.perf_counter()
    ttft, events = 0.0, 0
    async with session.post(url + "/v1/completions", json={"prompt": "x", "stream": True}) as resp:
        async for line in resp.content:
            if line.startswith(b"data: "):
                events += 1
                ttft = ttft or time.perf_counter() - start
    return ttft, time.perf_counter() - start, events


async def load(url: str, num: int, concurrency: int) -> list[tuple[float, float, int]]:
    gate = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def gated() -> tuple[float, float, int]:
            async with gate:
                return await one_request(session, url)
        return await asyncio.gather(*(gated() for _ in range(num)))


def _summary(results: list[tuple[float, float, int]]) -> dict:
    def pct(values: list[float], q: int) -> float:
        return round(statistics.quantiles(values, n=100)[q - 1] * 1000, 3)

    ttft, e2e = [r[0] for r in results], [r[1] for r in results]
    return {"ttft_ms_p50": pct(ttft, 50), "ttft_ms_p99": pct(ttft, 99), "e2e_ms_p50": pct(e2e, 50),
            "e2e_ms_p99": pct(e2e, 99), "events": sum(r[2] for r in results)}


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime + stime


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def _start_router(backend: str, port: int) -> asyncio.subprocess.Process:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "mtpserve.router.main", "--prefill", backend, "--decode", backend,
        "--port", str(port), "--health-interval", "0.2", "--log-level", "warning",
        stdout=asyncio.subprocess.DEVNULL)
    async with aiohttp.ClientSession() as session:
        for _ in range(300):
            try:
                async with session.get(f"http://127.0.0.1:{port}/health") as resp:
                    if resp.status == 200:
                        return proc
            except aiohttp.ClientConnectionError:
                pass
            await asyncio.sleep(0.1)
    proc.kill()
    raise RuntimeError("router did not become healthy")


async def bench(args: argparse.Namespace) -> dict:
    runner = web.AppRunner(synthetic_instance(args.tokens, args.step_ms / 1000), access_log=None)
    await runner.setup()
    backend_port, router_port = _free_port(), _free_port()
    await web.TCPSite(runner, "127.0.0.1", backend_port).start()
    backend = f"http://127.0.0.1:{backend_port}"
    proc = await _start_router(backend, router_port)
    try:
        await load(backend, args.concurrency, args.concurrency)  # NOTE: warm-up, not measured
        direct = _summary(await load(backend, args.requests, args.concurrency))
        await load(f"http://127.0.0.1:{router_port}", args.concurrency, args.concurrency)
        cpu_before = _cpu_s(proc.pid)
        routed = _summary(await load(f"http://127.0.0.1:{router_port}", args.requests, args.concurrency))
        cpu = _cpu_s(proc.pid) - cpu_before
    finally:
        proc.terminate()
        await proc.wait()
        await runner.cleanup()
    return {"config": {k: str(v) for k, v in vars(args).items() if k != "func"}, "direct": direct,
            "router": routed, "router_cpu_ms_per_request": round(cpu * 1000 / args.requests, 3),
            "router_cpu_us_per_event": round(cpu * 1e6 / max(routed["events"], 1), 2)}


def run(args: argparse.Namespace) -> int:
    import uvloop

    report = uvloop.run(bench(args))
    for name in ("direct", "router"):
        print(f"{name:>7}: " + "  ".join(f"{k}={v}" for k, v in report[name].items()))
    print(f"router CPU: {report['router_cpu_ms_per_request']} ms/request, "
          f"{report['router_cpu_us_per_event']} us/event")
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = _options(argparse.ArgumentParser(prog="mtpserve.router.bench", description=(__doc__ or "").split("\n")[0]))
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
