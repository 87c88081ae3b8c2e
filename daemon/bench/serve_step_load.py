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
    return summarize_steps(results, time.perf_counter() - start, start, period_s)


def summarize_steps(results: list[RequestResult], elapsed: float, start: float = 0.0,
                    period_s: float = 0.0) -> dict:
    """With the load's start and period: also the output tok/s within the LOW and within the HIGH
    phases (phase_throughput), each chunk's tokens counted in the phase it arrived in."""
    ok = [r for r in results if r.ok]
    gaps = np.array([g for r in ok for g in r.itl]) if ok else np.zeros(1)
    return {"completed": len(ok), "failed": len(results) - len(ok), "elapsed_s": elapsed,
            "errors": sorted({r.error for r in results if not r.ok})[:5],
            "output_throughput": sum(r.output_tokens for r in ok) / elapsed,
            "gap_p50_ms": 1e3 * float(np.percentile(gaps, 50)), "gap_p99_ms": 1e3 * float(np.percentile(gaps, 99)),
            "gap_max_ms": 1e3 * float(gaps.max()),
            "ttft_max_ms": 1e3 * max((r.ttft for r in ok), default=0.0),
            "phase_throughput": phase_throughput(ok, elapsed, start, period_s) if period_s > 0 else None}


def phase_throughput(results: list[RequestResult], elapsed: float, start: float, period_s: float) -> dict:
    """{"low": tok/s, "high": tok/s} over the time spent in each phase. A request's tokens are spread
    evenly over its chunks (a chunk's own count is not kept), and each chunk lands in the phase of its
    arrival: a request that began in a HIGH phase and finished in the LOW one counts in both."""
    tokens = np.zeros(2)
    for r in results:
        if not r.num_chunks:
            continue
        arrivals = r.start + r.ttft + np.concatenate(([0.0], np.cumsum(r.itl)))
        phases = ((arrivals - start) // period_s).astype(np.int64) % 2  # 0: LOW, 1: HIGH
        tokens += np.bincount(phases, minlength=2)[:2] * r.output_tokens / len(arrivals)
    whole, rest = divmod(elapsed, period_s)
    seconds = np.array([whole // 2 + whole % 2, whole // 2]) * period_s  # LOW phases come first
    seconds[int(whole) % 2] += rest
    return {"low": float(tokens[0] / max(seconds[0], 1e-9)), "high": float(tokens[1] / max(seconds[1], 1e-9))}


def format_step_load(label: str, s: dict) -> str:
    return (f"{label}: {s['completed']} requests ({s['failed']} failed) in {s['elapsed_s']:.0f} s, "
            f"{s['output_throughput']:.1f} out tok/s, chunk gap p50 {s['gap_p50_ms']:.1f} ms, "
            f"p99 {s['gap_p99_ms']:.1f} ms, max {s['gap_max_ms']:.1f} ms" + _phases(s.get("phase_throughput")))


def _phases(phases: dict | None) -> str:
    return "" if phases is None else f"; out tok/s in LOW phases {phases['low']:.1f}, in HIGH {phases['high']:.1f}"
