"""The asyncio reader over both real transports: frames in order, bad messages counted and survived,
a removed channel turns into EngineDead instead of a hang."""

import asyncio

import numpy as np
import posix_ipc
import pytest

from mtpserve.ipc import sysv, wire
from mtpserve.ipc.output_reader import EngineDead, OutputReader
from mtpserve.ipc.wire_encode import encode_control, encode_token_frame
from wire_strategies import assert_frame_matches, control, make_step

TRANSPORTS = ["posix", "sysv"]


class Injector:
    """Puts raw messages on the channel's queue, as a (possibly broken) engine would."""

    def __init__(self, channel) -> None:
        self.address = channel.address
        if self.address.transport is wire.Transport.POSIX:
            self._mq = posix_ipc.MessageQueue(self.address.queue_name, write=True, read=False)
        else:
            self._qid = sysv.open_existing(self.address.sysv_key)

    def send(self, message: bytes) -> None:
        if self.address.transport is wire.Transport.POSIX:
            self._mq.send(message, timeout=1)
        else:
            assert sysv.send(self._qid, message)

    def frame(self, seq: int, step) -> bytes:
        return encode_token_frame(wire.Kind.TARGET, req_ids=step.req_ids, seq=step.seq,
                                  num_tokens=step.num_tokens, finish=step.finish,
                                  token_ids=step.token_ids, frame_seq=seq,
                                  instance_tag=self.address.instance_tag)


def small_step(seed: int):
    step = make_step(seed, 4, 2, 0, False)
    return step._replace(seq=np.zeros(4, np.int64), finish=np.zeros(4, np.int32))


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_frames_arrive_in_order_and_garbage_is_counted(make_channel, transport):
    ch = make_channel(transport)
    reader = OutputReader(ch, liveness_interval=0.05)
    await reader.start()
    inject = Injector(ch)
    steps = [small_step(i) for i in range(3)]
    inject.send(inject.frame(0, steps[0]))
    inject.send(b"\x00" * 100)
    inject.send(inject.frame(1, steps[1])[:-3])
    inject.send(inject.frame(2, steps[2]))
    first = await asyncio.wait_for(reader.get(), 2)
    second = await asyncio.wait_for(reader.get(), 2)
    assert_frame_matches(first, steps[0])
    assert_frame_matches(second, steps[2])
    assert reader.stats.rejected == {"magic": 1, "truncated": 1}
    assert reader.stats.frames_lost == 1
    await reader.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_control_frames_are_delivered(make_channel, transport):
    ch = make_channel(transport)
    reader = OutputReader(ch)
    await reader.start()
    Injector(ch).send(encode_control(wire.ControlCode.ENGINE_STOP, "bye",
                                     instance_tag=ch.address.instance_tag))
    got = control(await asyncio.wait_for(reader.get(), 2))
    assert got.code is wire.ControlCode.ENGINE_STOP and got.message == "bye"
    await reader.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_removed_channel_marks_the_engine_dead(make_channel, transport):
    ch = make_channel(transport)
    from mtpserve.ipc.output_channel import OutputChannel
    reader = OutputReader(OutputChannel.attach(ch.address.instance), liveness_interval=0.05)
    await reader.start()
    ch.remove()
    with pytest.raises(EngineDead):
        await asyncio.wait_for(reader.get(), 2)
    with pytest.raises(EngineDead):  # and stays dead, no spinning
        await asyncio.wait_for(reader.get(), 2)
    await reader.close()
    reader.channel.close()


async def test_an_unlinked_posix_queue_name_does_not_stop_a_running_reader(make_channel):
    """mq_unlink removes the name, not the queue: the sender's and the reader's descriptors still work."""
    ch = make_channel("posix")
    reader = OutputReader(ch, liveness_interval=0.05)
    await reader.start()
    inject = Injector(ch)
    posix_ipc.unlink_message_queue(ch.address.queue_name)
    await asyncio.sleep(0.2)  # several liveness checks
    step = small_step(7)
    inject.send(inject.frame(0, step))
    assert_frame_matches(await asyncio.wait_for(reader.get(), 2), step)
    await reader.close()


async def test_the_sysv_reader_thread_leaves_the_loop_free(make_channel):
    """While the reader thread blocks in msgrcv, the loop keeps running other work."""
    ch = make_channel("sysv")
    reader = OutputReader(ch)
    await reader.start()
    ticks = 0
    for _ in range(20):
        await asyncio.sleep(0.001)
        ticks += 1
    assert ticks == 20 and reader._thread is not None and reader._thread.is_alive()
    await reader.close()
    assert reader._thread is None
