"""One streamed request against an OpenAI-compatible server, timed chunk by chunk (client side).

TTFT is the first chunk carrying text; ITL are the gaps between text-carrying chunks (under MTP one
chunk may carry several tokens, so ITL is per chunk and TPOT, from token counts, is per token).
Output tokens come from the server's usage (stream_options.include_usage), else the chunk count.
"""

from __future__ import annotations

import json
import time
from typing import NamedTuple

import aiohttp


class RequestResult(NamedTuple):
    ok: bool
    error: str
    start: float  # perf_counter at send
    ttft: float  # s, 0 when nothing arrived
    latency: float  # s, send -> [DONE]
    itl: list[float]  # s, gaps between text-carrying chunks
    prompt_tokens: int
    output_tokens: int
    num_chunks: int  # text-carrying chunks
    spec_decode: dict | None  # mtpserve's per-request usage extension, when the server has it


def _has_text(chunk: dict) -> bool:
    for choice in chunk.get("choices") or ():
        if choice.get("text") or (choice.get("delta") or {}).get("content"):
            return True
    return False


class _Timing:
    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.first: float | None = None
        self.last = self.start
        self.itl: list[float] = []

    def chunk(self) -> None:
        now = time.perf_counter()
        if self.first is None:
            self.first = now
        else:
            self.itl.append(now - self.last)
        self.last = now


async def send_request(session: aiohttp.ClientSession, url: str, body: dict) -> RequestResult:
    timing, usage, error = _Timing(), {}, ""
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                return _failed(timing, f"HTTP {resp.status}: {(await resp.text())[:200]}")
            async for line in resp.content:
                kind, obj = _parse(line)
                if kind == "done":
                    break
                if kind == "event":
                    if "error" in obj:
                        error = str(obj["error"].get("message", obj["error"]))
                        continue
                    usage = obj.get("usage") or usage
                    if _has_text(obj):
                        timing.chunk()
    except (aiohttp.ClientError, TimeoutError) as exc:
        return _failed(timing, f"{type(exc).__name__}: {exc}")
    if error:
        return _failed(timing, error)
    return _result(timing, usage)


def _parse(line: bytes) -> tuple[str, dict]:
    line = line.strip()
    if not line.startswith(b"data:"):
        return "skip", {}
    data = line[5:].strip()
    return ("done", {}) if data == b"[DONE]" else ("event", json.loads(data))


def _failed(timing: _Timing, error: str) -> RequestResult:
    return RequestResult(False, error, timing.start, 0.0, time.perf_counter() - timing.start, [], 0, 0, 0, None)


def _result(timing: _Timing, usage: dict) -> RequestResult:
    num_chunks = len(timing.itl) + (timing.first is not None)
    return RequestResult(
        True, "", timing.start, (timing.first or timing.last) - timing.start, time.perf_counter() - timing.start,
        timing.itl, usage.get("prompt_tokens", 0), usage.get("completion_tokens", num_chunks), num_chunks,
        usage.get("spec_decode"))


async def reset_prefix_cache(session: aiohttp.ClientSession, base_url: str) -> bool:
    """POST /reset_prefix_cache; False where the server has no such endpoint (a peer) or refuses it.

    NOTE: every level sends the same first prompts, so a cache that kept an earlier level's served this one
    hits, and more of them on an instance with more KV blocks: a K=3 instance spends part of the same
    kv_cache_mb on its depths' KV, so at 64 streams k0 kept ~1.7x the blocks of the adaptive instance."""
    try:
        # NOTE: an empty JSON object: mtpserve refuses a POST of another content type (415)
        async with session.post(f"{base_url}/reset_prefix_cache", json={}) as resp:
            return resp.status == 200
    except aiohttp.ClientError:
        return False
