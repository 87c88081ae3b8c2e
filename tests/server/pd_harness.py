"""A PD instance for the tests: the HTTP app (aiohttp TestServer) + an in-process PdFakeEngine.

`async with pd_instance(tmp_path, text_model, "prefill") as inst:` gives `inst.url`, `inst.engine`
(what it received, what it holds) and `inst.text`. Everything is torn down on exit: the engine task,
the request socket, the output queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from aiohttp.test_utils import TestServer

from mtpserve.ipc.output_channel import OutputChannel
from mtpserve.ipc.request_channel import RequestChannelServer
from mtpserve.server.app import make_app
from mtpserve.config import Config, PdConfig, ServerConfig
from mtpserve.server.text_model import TextModel
from pd_fake_engine import PdFakeEngine, PdFrameSink, fake_args
from server_harness import MODEL_NAME, open_fake_output, wait_healthy


@dataclass
class PdInstance:
    url: str
    engine: PdFakeEngine
    text: TextModel


@contextlib.asynccontextmanager
async def pd_instance(tmp_path: Path, text: TextModel, role: str, api_key: str = "", engine_role: str | None = None):
    runtime = tmp_path / f"rt-{role}-{uuid.uuid4().hex[:6]}"
    runtime.mkdir(mode=0o700)
    instance = f"t{os.getpid()}-{uuid.uuid4().hex[:8]}"
    channel = OutputChannel.create(instance, "posix")
    server = await RequestChannelServer.start(runtime)
    sink = PdFrameSink(instance, text.vocab_size)
    engine = PdFakeEngine(server, sink, fake_args(text.vocab_size), engine_role or role)
    server.set_ready(engine.ready())
    task = asyncio.create_task(engine.run())
    config = Config(server=ServerConfig(served_model_name=MODEL_NAME, api_key=api_key, heartbeat_timeout=10.0),
                    pd=PdConfig(role=role, kv_lease_timeout=5.0))
    http = TestServer(make_app(config, MODEL_NAME, text, runtime, open_fake_output), handler_cancellation=True)
    try:
        await http.start_server()
        url = str(http.make_url("")).rstrip("/")
        if engine_role is None:
            await wait_healthy(url, 10.0)
        yield PdInstance(url, engine, text)
    finally:
        await http.close()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        sink.close()
        await server.close()
        channel.remove()


async def until(predicate, timeout_s: float = 5.0) -> None:
    """Wait for something the fake engine sees asynchronously (a ReleaseKV, an AddRequest)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition never became true"
        await asyncio.sleep(0.01)
