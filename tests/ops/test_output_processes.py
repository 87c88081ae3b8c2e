"""The real topology: the send op in an engine process, the asyncio reader in this one."""

import asyncio
import sys
from pathlib import Path

import pytest

from mtpserve.ipc.output_reader import OutputReader
from wire_strategies import VOCAB, assert_frame_matches, make_step

ENGINE = """
import sys
sys.path.insert(0, {strategies!r})
from mtpserve import ops
from mtpserve.ipc.output_channel import OutputChannel
from wire_strategies import VOCAB, make_step

channel = OutputChannel.attach({instance!r})
sender = ops.OutputSender(channel.address, rank=0, vocab_size=VOCAB)
for i in range({steps}):
    s = make_step(i, 96, 4, 5, True)
    status = ops.SendStatus.of(sender.send_step(
        step_id=i, req_ids=s.req_ids, seq=s.seq, num_tokens=s.num_tokens, finish=s.finish,
        token_ids=s.token_ids, logprobs=ops.StepLogprobs(s.logprob, s.rank, s.topk_ids,
        s.topk_logprobs), num_topk=5))
    while status.frames_pending:
        status = ops.SendStatus.of(sender.flush())
print(ops.SendStatus.of(sender.flush()).frames_sent, sender.close().frames_pending)
"""


@pytest.mark.parametrize("transport", ["posix", "sysv"])
async def test_frames_cross_processes_bit_exact(open_channel, transport):
    ch, _ = open_channel(transport)
    reader = OutputReader(ch, vocab_size=VOCAB, track_seq=False)
    await reader.start()
    steps = 30
    script = ENGINE.format(strategies=str(Path(__file__).parents[1] / "ipc"),
                           instance=ch.address.instance, steps=steps)
    engine = await asyncio.create_subprocess_exec(sys.executable, "-c", script,
                                                  stdout=asyncio.subprocess.PIPE)
    frames = [await asyncio.wait_for(reader.get(), 30) for _ in range(steps)]
    out, _ = await engine.communicate()
    assert engine.returncode == 0 and out.split() == [str(steps).encode(), b"0"]
    for i, frame in enumerate(frames):
        assert frame.step_id == i
        assert_frame_matches(frame, make_step(i, 96, 4, 5, True))
    assert not reader.stats.rejected and reader.stats.frames_lost == 0
    await reader.close()
