"""Round trips of every request-channel message over a real Unix socket, plus the socket's guarantees."""

import asyncio
import os
import stat

import msgspec
import pytest

from mtpserve.ipc.request_channel import (
    AbortRequest,
    AddRequest,
    ChannelClosed,
    EngineReady,
    EngineStats,
    FrameCodec,
    RequestChannelClient,
    RequestChannelServer,
    RequestFailed,
    SamplingParams,
    ToEngine,
    socket_path,
)

FULL_SAMPLING = SamplingParams(
    max_tokens=77, min_tokens=3, temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, seed=1234,
    presence_penalty=0.5, frequency_penalty=-0.25, repetition_penalty=1.1, stop_token_ids=(7, 9),
    ignore_eos=True, logprobs=20,
)
TO_ENGINE = [
    AddRequest(request_id=2**40 + 5, prompt_token_ids=list(range(1000)), sampling=FULL_SAMPLING, arrival_time=12.5),
    AddRequest(request_id=1, prompt_token_ids=[3], sampling=SamplingParams(max_tokens=1)),
    AbortRequest(request_ids=[1, 2, 3]),
]
TO_HTTP = [
    EngineReady(model_name="m", max_model_len=4096, vocab_size=32000, eos_token_ids=[2, 5],
                num_speculative_tokens=2, num_kv_blocks=512, kv_block_size=16, output_channel="posix:/x"),
    EngineStats(step_id=9, num_running=3, num_waiting=1, num_kv_blocks_used=10, num_kv_blocks_total=512,
                num_drafts=4, num_draft_tokens=8, num_accepted_tokens=5, num_accepted_per_pos=[3, 2], timestamp=1.5),
    RequestFailed(request_id=44, message="does not fit"),
]


@pytest.fixture
def runtime_dir(tmp_path):
    path = tmp_path / "rt"
    path.mkdir(mode=0o700)
    return path


@pytest.fixture
async def pair(runtime_dir):
    server = await RequestChannelServer.start(runtime_dir)
    client = await RequestChannelClient.connect(runtime_dir, timeout_s=5)
    yield server, client
    await client.close()
    await server.close()


@pytest.mark.parametrize("msg", TO_ENGINE, ids=lambda m: type(m).__name__)
async def test_to_engine_round_trip(pair, msg):
    server, client = pair
    client.send(msg)
    assert await asyncio.wait_for(server.recv(), 5) == msg


@pytest.mark.parametrize("msg", TO_HTTP, ids=lambda m: type(m).__name__)
async def test_to_http_round_trip(pair, msg):
    server, client = pair
    await _wait_for_clients(server, 1)
    server.send(msg)
    assert await asyncio.wait_for(client.recv(), 5) == msg


async def test_poll_drains_in_order_without_blocking(pair):
    server, client = pair
    assert server.poll() == []
    for msg in TO_ENGINE:
        client.send(msg)
    await client.drain()
    got = []
    for _ in range(100):
        got += server.poll()
        if len(got) == len(TO_ENGINE):
            break
        await asyncio.sleep(0.01)
    assert got == TO_ENGINE


async def test_late_client_gets_ready(runtime_dir):
    server = await RequestChannelServer.start(runtime_dir)
    server.set_ready(TO_HTTP[0])
    client = await RequestChannelClient.connect(runtime_dir, timeout_s=5)
    assert await client.wait_ready(5) == TO_HTTP[0]
    await client.close()
    await server.close()


async def test_socket_is_private_and_removed(runtime_dir):
    server = await RequestChannelServer.start(runtime_dir)
    mode = os.stat(socket_path(runtime_dir)).st_mode
    assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600
    await server.close()
    assert not socket_path(runtime_dir).exists()


async def test_refuses_open_runtime_dir(tmp_path):
    (tmp_path / "open").mkdir(mode=0o755)
    os.chmod(tmp_path / "open", 0o755)
    with pytest.raises(PermissionError):
        await RequestChannelServer.start(tmp_path / "open")


async def test_stale_socket_replaced_live_one_refused(runtime_dir):
    import socket
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(socket_path(runtime_dir)))
    stale.close()  # file stays, nobody listens
    server = await RequestChannelServer.start(runtime_dir)
    with pytest.raises(FileExistsError):
        await RequestChannelServer.start(runtime_dir)
    await server.close()


async def test_engine_death_is_channel_closed(pair):
    server, client = pair
    await server.close()
    with pytest.raises(ChannelClosed):
        await asyncio.wait_for(client.recv(), 5)


async def test_connect_waits_for_late_server(runtime_dir):
    connecting = asyncio.create_task(RequestChannelClient.connect(runtime_dir, timeout_s=5))
    await asyncio.sleep(0.2)
    server = await RequestChannelServer.start(runtime_dir)
    client = await asyncio.wait_for(connecting, 5)
    client.send(TO_ENGINE[2])
    assert await asyncio.wait_for(server.recv(), 5) == TO_ENGINE[2]
    await client.close()
    await server.close()


async def test_garbage_client_dropped_others_served(pair, runtime_dir):
    server, client = pair
    reader, writer = await asyncio.open_unix_connection(str(socket_path(runtime_dir)))
    writer.write(b"\x05\x00\x00\x00hello")
    await writer.drain()
    client.send(TO_ENGINE[2])
    assert await asyncio.wait_for(server.recv(), 5) == TO_ENGINE[2]
    assert await asyncio.wait_for(reader.read(), 5) == b""  # the garbage sender was disconnected
    writer.close()


def test_codec_rejects_wrong_direction():
    frame = FrameCodec(ToEngine).encode(TO_ENGINE[0])
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(frame[4:], type=EngineStats)


async def _wait_for_clients(server, n):
    for _ in range(500):
        if server.num_clients >= n:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("client never registered")


def test_the_engine_runs_the_wire_sampling_params_as_they_arrive():
    """One SamplingParams for both processes: what the engine runs is what the wire decoded."""
    from mtpserve.engine.request import EngineRequest
    from mtpserve.engine.request import SamplingParams as EngineSamplingParams

    assert EngineSamplingParams is SamplingParams
    for params in (FULL_SAMPLING, SamplingParams(max_tokens=1), SamplingParams(max_tokens=5, logprobs=0)):
        decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams)
        assert decoded == params
        assert EngineRequest(1, (1, 2), decoded).params == params
