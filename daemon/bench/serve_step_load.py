"""A load that steps: LOW concurrent streams, then HIGH, alternating every period, for a stated time.

Worker i sends streaming requests back to back while the current target exceeds i, so the number of
streams follows the steps (a stream that began in a HIGH phase finishes in the LOW one). What it shows:
total output tokens per second, and the gaps between a request's chunks (a policy that stalls when the
load crosses its switching point shows as a long gap).
"""

from __future__ import annotations

import asyncio
import itertools
import time

import aiohttp
import numpy as np

from mtpserve.bench.serve_client import RequestResult, send_request


async def step_load(session: aiohttp.ClientSession, url: str, bodies: list[dict], low: int, high: int,
                    period_s: float, duration_s: float) -> dict:
    cycle = itertools.cycle(bodies)
    start = time.perf_counter()
    results: list[RequestResult] = []

    def target() -> int:
        return low if int((time.perf_counter() - start) / period_s) % 2 == 0 else high

    async def worker(i: int) -> None:
        while time.perf_counter() - start < duration_s:
            if i >= target():
                await asyncio.sleep(0.02)
                continue
            results.append(await send_request(session, url, next(cycle)))

    await asyncio.gather(*(worker(i) for i in range(high)))
    return summarize_steps(results, time.perf_counter() - start)


def summarize_steps(results: list[RequestResult], elapsed: float) -> dict:
    ok = [r for r in results if r.ok]
    gaps = np.array([g for r in ok for g in r.itl]) if ok else np.zeros(1)
    return {"completed": len(ok), "failed": len(results) - len(ok), "elapsed_s": elapsed,
            "errors": sorted({r.error for r in results if not r.ok})[:5],
            "output_throughput": sum(r.output_tokens for r in ok) / elapsed,
            "gap_p50_ms": 1e3 * float(np.percentile(gaps, 50)), "gap_p99_ms": 1e3 * float(np.percentile(gaps, 99)),
            "gap_max_ms": 1e3 * float(gaps.max()),
            "ttft_max_ms": 1e3 * max((r.ttft for r in ok), default=0.0)}


def format_step_load(label: str, s: dict) -> str:
    return (f"{label}: {s['completed']} requests ({s['failed']} failed) in {s['elapsed_s']:.0f} s, "
            f"{s['output_throughput']:.1f} out tok/s, chunk gap p50 {s['gap_p50_ms']:.1f} ms, "
            f"p99 {s['gap_p99_ms']:.1f} ms, max {s['gap_max_ms']:.1f} ms")
