"""Helpers of the router tests: start a router app, read SSE bodies, wait for conditions."""

from __future__ import annotations

import asyncio
import json

from aiohttp.test_utils import TestClient, TestServer

from mtpserve.router.app import make_app
from mtpserve.router.config import RouterConfig

DONE = "[DONE]"


async def start_router(prefill_urls: list[str], decode_urls: list[str], wait: bool = True,
                       **options) -> TestClient:
    config = RouterConfig(prefill_urls=tuple(prefill_urls), decode_urls=tuple(decode_urls),
                          **{"health_interval": 0.05, **options})
    client = TestClient(TestServer(make_app(config), handler_cancellation=True))
    await client.start_server()
    if wait:
        await until(lambda: _healthy(client), what="router healthy")
    return client


async def _healthy(client: TestClient) -> bool:
    resp = await client.get("/health")
    await resp.read()
    return resp.status == 200


async def until(predicate, timeout: float = 5.0, what: str = "condition") -> None:
    """Wait for `predicate()` (sync or async) to hold; fail the test after `timeout` seconds."""
    async def poll() -> None:
        while True:
            value = predicate()
            if asyncio.iscoroutine(value):
                value = await value
            if value:
                return
            await asyncio.sleep(0.01)

    try:
        await asyncio.wait_for(poll(), timeout)
    except TimeoutError:
        raise AssertionError(f"timed out waiting for {what}") from None


def sse_events(raw: bytes) -> list:
    """Decoded `data:` payloads of an SSE body in order; `[DONE]` stays a string."""
    text = raw.decode()
    assert text.endswith("\n\n"), text[-200:]
    events = []
    for block in text.split("\n\n")[:-1]:
        assert block.startswith("data: "), block
        payload = block.removeprefix("data: ")
        events.append(DONE if payload == DONE else json.loads(payload))
    return events


def without_ids(events: list) -> list:
    return [{k: v for k, v in e.items() if k != "id"} if isinstance(e, dict) else e for e in events]


def joined_text(events: list) -> str:
    out = []
    for e in events:
        for choice in e.get("choices", []) if isinstance(e, dict) else []:
            out.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
    return "".join(out)
