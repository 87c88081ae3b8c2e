"""A synchronous, non-blocking reader of an output channel, for tools, benchmarks and tests.

The HTTP process uses OutputReader (asyncio); this one drains whatever is queued right now, on the
calling thread, with the same assembler, so both decode identically.
"""

from __future__ import annotations

import posix_ipc

from mtpserve.ipc import sysv, wire
from mtpserve.ipc.frame_assembler import FrameAssembler, ReaderStats
from mtpserve.ipc.output_channel import OutputChannel
from mtpserve.ipc.seq_tracker import SeqTracker
from mtpserve.ipc.token_frame import Frame


class PollingReader:
    def __init__(self, channel: OutputChannel, *, vocab_size: int | None = None,
                 track_seq: bool = True) -> None:
        address = channel.address
        self.tracker = SeqTracker() if track_seq else None
        self.assembler = FrameAssembler(address.instance_tag, channel.ring, vocab_size=vocab_size,
                                        tracker=self.tracker)
        if address.transport is wire.Transport.POSIX:
            self._mq = posix_ipc.MessageQueue(address.queue_name, read=True, write=False)
            self._mq.block = False
            self._receive = self._receive_posix
        else:
            self._receiver = sysv.Receiver(sysv.open_existing(address.sysv_key), address.max_msg_bytes)
            self._receive = self._receive_sysv

    @property
    def stats(self) -> ReaderStats:
        return self.assembler.stats

    def poll(self) -> list[Frame]:
        """Every frame completed by the messages queued now (possibly none)."""
        frames = []
        while (message := self._receive()) is not None:
            frames += self.assembler.feed(message)
        return frames

    def close(self) -> None:
        if self._receive == self._receive_posix:
            self._mq.close()

    def _receive_posix(self) -> bytes | None:
        try:
            return self._mq.receive()[0]
        except posix_ipc.BusyError:
            return None

    def _receive_sysv(self) -> bytes | None:
        got = self._receiver.recv(nowait=True)
        return None if got is None else got[1]
