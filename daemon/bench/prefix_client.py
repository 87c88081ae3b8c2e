"""The client side of `bench prefix` and `bench chat`: one streamed request kept whole (its text and its
usage, which carries `prompt_tokens_details.cached_tokens` and mtpserve's `spec_decode`), the prefix
cache's /metrics counters, the reset endpoint and /tokenize.

What a server does not have is unknown (None), never an error: a server without prefix caching has no
counters and no reset endpoint, and its usage has no cached_tokens.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Mapping
from typing import NamedTuple

import aiohttp

QUERIES = "vllm:prefix_cache_queries_total"  # prompt tokens looked up (vLLM counts tokens)
HITS = "vllm:prefix_cache_hits_total"  # prompt tokens found cached
CACHE_BLOCKS = "mtpserve:prefix_cache_blocks"  # gauge: blocks holding cached prefixes


class Reply(NamedTuple):
    ok: bool
    error: str
    text: str  # the streamed text, joined
    ttft_s: float  # send -> first chunk carrying text (0 when none arrived)
    latency_s: float  # send -> [DONE]
    usage: dict  # the last usage object seen ({} when none)

    def figures(self) -> dict:
        """The per-request figures both benchmarks report (None where the server gave nothing)."""
        completion = self.usage.get("completion_tokens")
        decode_s = self.latency_s - self.ttft_s
        return {"ok": self.ok, "ttft_ms": 1000 * self.ttft_s if self.ok else None,
                "decode_tok_s": (completion - 1) / decode_s if completion and completion > 1 and decode_s > 0
                else None,
                "acceptance_length": acceptance_length(self.usage), "cached_tokens": cached_tokens(self.usage),
                "prompt_tokens": self.usage.get("prompt_tokens"), "completion_tokens": completion}


def cached_tokens(usage: dict) -> int | None:
    return (usage.get("prompt_tokens_details") or {}).get("cached_tokens")


def acceptance_length(usage: dict) -> float | None:
    return (usage.get("spec_decode") or {}).get("mean_acceptance_length")


def read_metric(text: str, name: str) -> float | None:
    """A metric summed over its label sets (Prometheus text format); None when it is not exported."""
    values = re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.eE+-]+|NaN)$", text, re.M)
    return sum(map(float, values)) if values else None


def parse_sse(line: bytes) -> dict | None:
    """One SSE line -> its JSON event; None for other lines and for [DONE]."""
    line = line.strip()
    if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
        return None
    return json.loads(line[5:])


def chunk_text(event: dict) -> str:
    choices = event.get("choices") or ()
    return "".join(c.get("text") or (c.get("delta") or {}).get("content") or "" for c in choices)


class BenchClient:
    """One server: a session, its base URL and the model name to send."""

    def __init__(self, session: aiohttp.ClientSession, base_url: str, model: str) -> None:
        self.session, self.base_url, self.model = session, base_url.rstrip("/"), model

    @staticmethod
    async def first_model(session: aiohttp.ClientSession, base_url: str) -> tuple[str, int | None]:
        """The server's first /v1/models entry: its id and max_model_len (None when not given)."""
        async with session.get(f"{base_url.rstrip('/')}/v1/models") as resp:
            resp.raise_for_status()
            card = (await resp.json())["data"][0]
        return card["id"], card.get("max_model_len")

    async def stream(self, path: str, body: dict) -> Reply:
        """POST `body` (made streaming, with usage) to `path` and read the answer to its end."""
        body = {**body, "model": self.model, "stream": True, "stream_options": {"include_usage": True}}
        start, first, parts, usage = time.perf_counter(), None, [], {}
        try:
            async with self.session.post(self.base_url + path, json=body) as resp:
                if resp.status != 200:
                    return _failed(start, f"HTTP {resp.status}: {(await resp.text())[:200]}")
                async for line in resp.content:
                    event = parse_sse(line)
                    if event is None:
                        continue
                    if "error" in event:
                        return _failed(start, str(event["error"].get("message", event["error"])))
                    usage = event.get("usage") or usage
                    if text := chunk_text(event):
                        first = first or time.perf_counter()
                        parts.append(text)
        except (aiohttp.ClientError, TimeoutError) as exc:
            return _failed(start, f"{type(exc).__name__}: {exc}")
        end = time.perf_counter()
        return Reply(True, "", "".join(parts), (first or end) - start, end - start, usage)

    async def tokenize(self, text: str) -> list[int]:
        body = {"model": self.model, "prompt": text, "add_special_tokens": False}
        async with self.session.post(f"{self.base_url}/tokenize", json=body) as resp:
            resp.raise_for_status()
            return (await resp.json())["tokens"]

    async def reset_prefix_cache(self) -> int | None:
        """POST /reset_prefix_cache: the blocks it forgot, or None when the server has no such endpoint
        (or answers without a count)."""
        try:
            # NOTE: an empty JSON object: mtpserve refuses a POST of another content type (415)
            async with self.session.post(f"{self.base_url}/reset_prefix_cache", json={}) as resp:
                if resp.status != 200:
                    return None
                answer = await resp.json(content_type=None)
        except (aiohttp.ClientError, ValueError):
            return None
        return answer.get("num_blocks") if isinstance(answer, dict) else None

    async def metrics(self) -> dict[str, float | None]:
        """The prefix cache's counters and gauge (None each when not exported)."""
        try:
            async with self.session.get(f"{self.base_url}/metrics") as resp:
                text = await resp.text() if resp.status == 200 else ""
        except aiohttp.ClientError:
            text = ""
        return {name: read_metric(text, name) for name in (QUERIES, HITS, CACHE_BLOCKS)}


def hit_rate(before: Mapping[str, float | None], after: Mapping[str, float | None]) -> dict:
    """Queried and hit prompt tokens between two scrapes, and their ratio; None when either is missing."""
    queries, hits = (_delta(before.get(name), after.get(name)) for name in (QUERIES, HITS))
    return {"queried_tokens": queries, "hit_tokens": hits,
            "hit_rate": hits / queries if queries and hits is not None else None}


def _delta(before: float | None, after: float | None) -> float | None:
    return None if before is None or after is None else after - before


def session(api_key: str | None) -> aiohttp.ClientSession:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=None, sock_read=600),
                                 connector=aiohttp.TCPConnector(limit=0))


def _failed(start: float, error: str) -> Reply:
    return Reply(False, error, "", 0.0, time.perf_counter() - start, {})
