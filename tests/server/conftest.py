"""Fixtures of the HTTP-process tests (helpers live in server_harness.py)."""

from __future__ import annotations

import asyncio
import gc
import time
from pathlib import Path

import pytest
from aiohttp.test_utils import TestServer

from mtpserve.server.app import make_app
from mtpserve.config import Config, ServerConfig
from mtpserve.server.text_model import TextModel
from server_harness import MODEL_NAME, open_fake_output, start_fake_engine, wait_healthy, write_model_dir


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    return write_model_dir(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="session")
def text_model(model_dir) -> TextModel:
    return TextModel.from_dir(model_dir)


@pytest.fixture
async def no_loop_blocking():
    """Fail the test if a loop iteration holds the event loop for more than 0.25 s of CPU.

    NOTE: the loop thread's CPU time, not wall time, so that being descheduled on a busy 2-core host
    is not mistaken for blocking; a blocking sleep or syscall shows as a wall-time stall (> 1 s).
    """
    worst_cpu, worst_wall = [0.0], [0.0]
    stop = False

    async def watch() -> None:
        while not stop:
            wall, cpu = time.monotonic(), time.thread_time()
            await asyncio.sleep(0.01)
            wall = time.monotonic() - wall - 0.01
            worst_cpu[0] = max(worst_cpu[0], min(wall, time.thread_time() - cpu))
            worst_wall[0] = max(worst_wall[0], wall)

    # NOTE: objects left by earlier tests in this pytest process would make a full GC pass look
    # like our code blocking the loop; freezing them keeps the measurement about this test.
    gc.collect()
    gc.freeze()
    task = asyncio.get_running_loop().create_task(watch())
    try:
        yield
    finally:
        stop = True
        await task
        gc.unfreeze()
    assert worst_cpu[0] < 0.25, f"event loop busy for {worst_cpu[0]:.3f}s of CPU in one iteration"
    assert worst_wall[0] < 1.0, f"event loop stalled for {worst_wall[0]:.3f}s"


@pytest.fixture
def engine_args() -> list[str]:
    return []


@pytest.fixture(params=["posix"])
def transport(request) -> str:
    """Output-channel transport of the fake engine; modules override it to run both."""
    return request.param


@pytest.fixture
def settings() -> Config:
    """The configuration the HTTP app is built from (its [server] and [pd] sections)."""
    return Config(server=ServerConfig(served_model_name=MODEL_NAME, max_concurrent_requests=128,
                                      max_body_bytes=64 * 1024, heartbeat_timeout=10.0))


@pytest.fixture
async def fake_server(tmp_path, text_model, settings, engine_args, transport):
    """(base_url, app) of an HTTP app connected to a fake engine process; both stopped afterwards."""
    runtime_dir = tmp_path / "rt"
    proc = start_fake_engine(runtime_dir, text_model.vocab_size, *engine_args, transport=transport)
    app = make_app(settings, MODEL_NAME, text_model, runtime_dir, open_fake_output)
    server = TestServer(app, handler_cancellation=True)
    await server.start_server()
    base_url = str(server.make_url("")).rstrip("/")
    try:
        await wait_healthy(base_url)
        yield base_url, app
    finally:
        await server.close()
        proc.stop()
