"""Counters kept outside the HTTP process's own code reach /metrics: the output reader's rejects, lost
frames and seq errors, and the engine's preemptions and discarded rows (from its EngineStats)."""

import asyncio

import aiohttp
import posix_ipc

from mtpserve.ipc.output_channel import OutputChannel
from mtpserve.server.context import CONTEXT
from server_harness import LONG, MODEL_NAME, metrics


def counter(text: str, name: str, **labels: str) -> float:
    """The value of one sample of `name` (labels matched exactly, model_name included)."""
    want = {"model_name": MODEL_NAME, **labels}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            body, value = line[len(name) + 1:].rsplit("} ", 1)
            got = dict(part.split("=", 1) for part in body.split(","))
            if {k: v.strip('"') for k, v in got.items()} == want:
                return float(value)
    return 0.0


async def test_reader_rejects_are_exported_and_the_stream_goes_on(fake_server):
    base_url, app = fake_server
    engine = app[CONTEXT].engine
    address = OutputChannel.attach(engine.ready.output_channel).address
    queue = posix_ipc.MessageQueue(address.queue_name, read=False, write=True)
    async with aiohttp.ClientSession() as session:
        before = await metrics(session, base_url)
        assert "mtpserve:output_frames_lost_total" in before and "mtpserve:output_seq_errors_total" in before
        queue.send(b"\x00" * 8)  # shorter than any header
        queue.close()
        after = ""
        for _ in range(100):
            after = await metrics(session, base_url)
            if counter(after, "mtpserve:output_frames_rejected_total", reason="truncated") == 1:
                break
            await asyncio.sleep(0.02)
        assert counter(after, "mtpserve:output_frames_rejected_total", reason="truncated") == 1
        body = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 4}
        async with session.post(base_url + "/v1/completions", json=body) as r:
            assert r.status == 200 and (await r.json())["usage"]["completion_tokens"] == 4


async def test_engine_preemptions_and_discarded_rows_are_exported(fake_server):
    """The fake engine reports one preemption per abort and one discarded row per finish."""
    base_url, _ = fake_server
    body = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 3}
    async with aiohttp.ClientSession() as session:
        for _ in range(3):
            async with session.post(base_url + "/v1/completions", json=body) as r:
                assert r.status == 200
        async with session.post(base_url + "/v1/completions", json=LONG) as r:
            await r.content.readline()  # the client leaves mid-stream: the engine gets an abort
        text = ""
        for _ in range(100):  # NOTE: the engine's heartbeat comes every 0.5 s
            text = await metrics(session, base_url)
            if counter(text, "vllm:num_preemptions_total") >= 1:
                break
            await asyncio.sleep(0.05)
        assert counter(text, "mtpserve:discarded_rows_total") == 3
        assert counter(text, "vllm:num_preemptions_total") == 1


async def test_the_ipc_reader_keys_reach_the_output_reader(tmp_path, text_model, settings):
    """ipc.reader_max_buffered and ipc.liveness_interval configure the HTTP process's reader."""
    import dataclasses

    from aiohttp.test_utils import TestServer

    from mtpserve.config import IpcConfig
    from mtpserve.server.app import make_app
    from mtpserve.server.output_source import FrameOutputSource
    from server_harness import open_fake_output, start_fake_engine, wait_healthy

    config = dataclasses.replace(settings, ipc=IpcConfig(reader_max_buffered=3, liveness_interval=0.25))
    proc = start_fake_engine(tmp_path / "rt", text_model.vocab_size)
    server = TestServer(make_app(config, MODEL_NAME, text_model, tmp_path / "rt", open_fake_output))
    await server.start_server()
    try:
        await wait_healthy(str(server.make_url("")).rstrip("/"))
        engine = server.app[CONTEXT].engine
        assert engine is not None
        output = engine._output
        assert isinstance(output, FrameOutputSource)
        assert output.reader.max_buffered == 3 and output.reader.liveness_interval == 0.25
    finally:
        await server.close()
        proc.stop()
