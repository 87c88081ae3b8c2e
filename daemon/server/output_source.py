"""The output path as the tracker consumes it: ipc's OutputReader frames -> per-request TokenDeltas.

The channel (queue + ring) is owned by the supervisor; this side attaches by instance name, which
rank 0 reports in EngineReady.output_channel. Conversion is per frame: one `tolist()` per array and
list slices per request (TokenFrame.requests), never a loop over tokens.
"""

from __future__ import annotations

import numpy as np

from mtpserve.config import IpcConfig
from mtpserve.ipc import wire
from mtpserve.ipc.frame_assembler import ReaderStats
from mtpserve.ipc.output_channel import OutputChannel
from mtpserve.ipc.output_reader import EngineDead, OutputReader
from mtpserve.ipc.request_channel import EngineReady
from mtpserve.ipc.token_frame import ControlMessage, RequestOutput, TokenFrame
from mtpserve.server.outputs import OutputClosed, TokenDelta

_FINISH: dict[int, str | None] = {wire.Finish.RUNNING: None, wire.Finish.PREEMPTED: None, wire.Finish.STOP: "stop",
           wire.Finish.LENGTH: "length", wire.Finish.ABORT: "abort", wire.Finish.ERROR: "error"}
_TOKEN_KINDS = (wire.Kind.TARGET, wire.Kind.FIRST_TOKEN)  # DRAFT frames are for draft-logprob studies


class FrameOutputSource:
    def __init__(self, channel: OutputChannel, reader: OutputReader) -> None:
        self._channel, self._reader = channel, reader

    @classmethod
    async def open(cls, instance: str, vocab_size: int | None = None,
                   ipc: IpcConfig = IpcConfig()) -> FrameOutputSource:
        """`ipc`: the reader's limits (reader_max_buffered, liveness_interval)."""
        channel = OutputChannel.attach(instance)
        reader = OutputReader(channel, vocab_size=vocab_size, liveness_interval=ipc.liveness_interval,
                              max_buffered=ipc.reader_max_buffered)
        await reader.start()
        return cls(channel, reader)

    async def next_batch(self) -> list[TokenDelta]:
        """The next token frame's deltas; OutputClosed when the engine stopped or the channel went."""
        while True:
            try:
                frame = await self._reader.get()
            except EngineDead as exc:
                raise OutputClosed(str(exc)) from None
            if isinstance(frame, ControlMessage):
                raise OutputClosed(f"engine {frame.code.name.lower()}: {frame.message}")
            if frame.kind in _TOKEN_KINDS:
                return to_deltas(frame)

    def expect_seq(self, request_id: int, start: int) -> None:
        # NOTE: called before the AddRequest leaves, so no frame of this request is in flight; the
        # tracker queues it for the thread that checks frames (the SysV reader's own thread).
        if self._reader.tracker is not None:
            self._reader.tracker.expect(request_id, start)

    def stats(self) -> ReaderStats:
        return self._reader.stats

    @property
    def reader(self) -> OutputReader:
        return self._reader

    def forget_seq(self, request_id: int) -> None:
        if self._reader.tracker is not None:
            self._reader.tracker.forget(request_id)

    async def close(self) -> None:
        await self._reader.close()
        self._channel.close()


def to_deltas(frame: TokenFrame) -> list[TokenDelta]:
    rows = frame.requests()
    bad = set() if frame.seq_ok is None else set(np.flatnonzero(~frame.seq_ok).tolist())
    return [_delta(row, "error" if i in bad else _FINISH.get(row.finish, "error")) for i, row in enumerate(rows)]


def _delta(row: RequestOutput, finish: str | None) -> TokenDelta:
    # NOTE: a seq gap means tokens were lost: the request fails loudly instead of showing wrong text
    return TokenDelta(row.req_id, row.token_ids, row.logprobs, row.top_ids, row.top_logprobs, finish, row.draft_ids)


async def open_output(ready: EngineReady, ipc: IpcConfig) -> FrameOutputSource:
    """main.py's OpenOutput: attach to the channel rank 0 named in its EngineReady."""
    return await FrameOutputSource.open(ready.output_channel, ready.vocab_size, ipc)
