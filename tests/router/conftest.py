"""Fixtures of the router tests: fake prefill/decode instances (fake_instance.py) and a router app
in front of them, all real aiohttp servers on loopback ports."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from aiohttp.test_utils import TestClient

from fake_instance import FakeInstance
from router_harness import start_router


async def _started(role: str):
    fake = FakeInstance(role)
    await fake.server.start_server()
    try:
        yield fake
    finally:
        await fake.server.close()


@pytest.fixture
async def prefill():
    async for fake in _started("prefill"):
        yield fake


@pytest.fixture
async def decode():
    async for fake in _started("decode"):
        yield fake


@pytest.fixture
async def mixed():
    async for fake in _started("mixed"):
        yield fake


@pytest.fixture
def router_options() -> dict:
    """RouterConfig fields a test module or test overrides."""
    return {}


@pytest.fixture
async def router(prefill, decode, router_options) -> AsyncIterator[TestClient]:
    client = await start_router([prefill.url], [decode.url], **router_options)
    try:
        yield client
    finally:
        await client.close()
