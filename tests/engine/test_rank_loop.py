"""Rank 0's loop between a real request channel and a real output channel, around an engine core on the
synthetic device: prefix hits are reported (PrefixHits) before the request's first output frame, a
ResetPrefixCache is answered with its token and the blocks forgotten, and the heartbeat carries the
prefix cache's counters and gauges."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import uuid
from dataclasses import dataclass, field

import pytest

from mtpserve import ops
from mtpserve.engine.engine_core import CoreConfig, EngineCore
from mtpserve.engine.rank_loop import RankLoop
from mtpserve.engine.scheduler import SchedulerConfig
from mtpserve.engine.synthetic_runner import SyntheticConfig, SyntheticRunner
from mtpserve.ipc import request_channel as rc
from mtpserve.ipc.output_channel import OutputChannel
from mtpserve.ipc.sampling_params import SamplingParams
from mtpserve.server.output_source import FrameOutputSource

VOCAB, BLOCK = 500, 4
PROMPT = list(range(1, 14))  # 13 tokens: three full blocks, the last token in a fourth
STEP_S = 0.05  # long enough that a message sent after the step would visibly trail its frame


@dataclass
class HttpSide:
    """What the HTTP process would see: control messages and token deltas, each with its arrival time."""

    client: rc.RequestChannelClient
    output: FrameOutputSource
    control: list[tuple[float, rc.ToHttp]] = field(default_factory=list)
    first_frame: dict[int, float] = field(default_factory=dict)  # request id -> arrival of its first delta
    finished: dict[int, asyncio.Event] = field(default_factory=dict)

    async def read_control(self) -> None:
        while True:
            msg = await self.client.recv()
            self.control.append((time.monotonic(), msg))

    async def read_output(self) -> None:
        while True:
            for delta in await self.output.next_batch():
                self.first_frame.setdefault(delta.request_id, time.monotonic())
                if delta.finish_reason is not None:
                    self.finished.setdefault(delta.request_id, asyncio.Event()).set()

    async def generate(self, request_id: int) -> None:
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        self.client.send(rc.AddRequest(request_id=request_id, prompt_token_ids=PROMPT, sampling=params))
        done = self.finished.setdefault(request_id, asyncio.Event())
        await asyncio.wait_for(done.wait(), 10)

    def received(self, kind: type) -> list:
        return [msg for _, msg in self.control if isinstance(msg, kind)]

    def arrival(self, msg: rc.ToHttp) -> float:
        return next(t for t, m in self.control if m is msg)

    async def next_stats(self) -> rc.EngineStats:
        """The first heartbeat sent after this call."""
        seen = len(self.received(rc.EngineStats))
        while len(stats := self.received(rc.EngineStats)) <= seen + 1:
            await asyncio.sleep(0.01)
        return stats[-1]

    async def reset(self, token: int, timeout_s: float = 10.0) -> rc.PrefixCacheReset:
        """Send ResetPrefixCache; its answer (the PrefixCacheReset with the same token)."""
        self.client.send(rc.ResetPrefixCache(token))
        deadline = time.monotonic() + timeout_s
        while not (found := [m for m in self.received(rc.PrefixCacheReset) if m.token == token]):
            assert time.monotonic() < deadline, f"no answer to reset {token}"
            await asyncio.sleep(0.01)
        [answer] = found
        return answer


@pytest.fixture
def overlap() -> bool:
    return True


@pytest.fixture
async def http(tmp_path, overlap):
    runtime_dir = tmp_path / "rt"
    runtime_dir.mkdir(mode=0o700)
    instance = f"rl{os.getpid()}-{uuid.uuid4().hex[:8]}"
    channel = OutputChannel.create(instance, "posix")
    sender = ops.OutputSender(channel.address, rank=0, vocab_size=VOCAB)
    server = await rc.RequestChannelServer.start(runtime_dir)
    sched = SchedulerConfig(max_num_seqs=4, num_blocks=64, block_size=BLOCK, enable_prefix_caching=True)
    runner = SyntheticRunner(SyntheticConfig(step_time_s=STEP_S, vocab_size=VOCAB, max_num_seqs=4,
                                             num_blocks=64, block_size=BLOCK))
    core = EngineCore(CoreConfig(sched, overlap=overlap), runner)
    stop = asyncio.Event()
    loop_task = asyncio.create_task(RankLoop(core, server, sender, stats_interval_s=0.05).run(stop))
    side = HttpSide(await rc.RequestChannelClient.connect(runtime_dir, 5),
                    await FrameOutputSource.open(instance, VOCAB))
    readers = [asyncio.create_task(side.read_control()), asyncio.create_task(side.read_output())]
    try:
        yield side
    finally:
        for task in readers:
            task.cancel()
        stop.set()
        await asyncio.wait_for(loop_task, 10)
        for task in readers:
            with contextlib.suppress(asyncio.CancelledError, rc.ChannelClosed):
                await task
        await side.client.close()
        await side.output.close()
        await server.close()
        core.close()
        sender.close()
        channel.remove()


@pytest.mark.parametrize("overlap", [True, False])
async def test_a_hit_is_reported_before_the_first_frame(http):
    await http.generate(1)
    assert not http.received(rc.PrefixHits)  # the first prompt finds nothing
    await http.generate(2)
    [hits] = http.received(rc.PrefixHits)
    assert hits.request_ids == [2] and hits.cached_tokens == [12]  # three full blocks, not the last token
    # NOTE: sent when the admitting step launched, not when it finished (without overlap, the step that
    # admits a request also emits its first token)
    assert http.arrival(hits) < http.first_frame[2] - STEP_S / 2


async def test_the_heartbeat_carries_the_prefix_cache(http):
    await http.generate(1)
    await http.generate(2)
    stats = await http.next_stats()
    assert stats.prefix_cache_queries == 2 * len(PROMPT)
    assert stats.prefix_cache_hits == 12
    assert stats.num_kv_blocks_cached >= 3
    # NOTE: idle, every cached block is evictable and counts as free: none is in use
    assert stats.num_kv_blocks_evictable == stats.num_kv_blocks_cached and stats.num_kv_blocks_used == 0


async def test_a_reset_is_answered_and_forgets_every_prefix(http):
    await http.generate(1)
    cached = (await http.next_stats()).num_kv_blocks_cached
    assert cached >= 3
    assert await http.reset(2**62 + 7) == rc.PrefixCacheReset(token=2**62 + 7, num_blocks=cached)
    assert (await http.next_stats()).num_kv_blocks_cached == 0
    await http.generate(2)
    assert not http.received(rc.PrefixHits)  # the same prompt again: nothing left to hit
    cached = (await http.next_stats()).num_kv_blocks_cached
    assert cached >= 3 and (await http.reset(1)).num_blocks == cached
