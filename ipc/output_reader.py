"""The HTTP side of the output channel: frames delivered on the asyncio loop.

1. POSIX: the queue's descriptor is registered with loop.add_reader; each wake-up drains the queue
   with non-blocking receives, assembling and decoding on the loop (a frame costs tens of µs).
2. SysV: one daemon thread blocks in msgrcv (ctypes releases the GIL), assembles and decodes, and
   hands each frame to the loop with call_soon_threadsafe.
3. Both: bad messages are counted (stats.rejected) and skipped; the reader keeps going.
4. A removed channel (SysV msgrcv fails with EIDRM; both: the ring's closed flag, a dead owner or a
   SysV queue gone, polled every liveness_interval seconds) marks the engine dead: get() raises
   EngineDead, the HTTP side answers 503 instead of waiting forever, and the HTTP process exits so the
   supervisor restarts the instance. A POSIX queue whose name was unlinked keeps working.
5. Back-pressure reaches the engine: at most max_buffered decoded frames wait for get(). Past that the
   POSIX reader leaves the descriptor alone and the SysV thread waits, so the queue and the ring fill
   and the engine's send op reports pending frames (and pauses) instead of this process buffering
   without bound.
"""

from __future__ import annotations

import asyncio
import errno
import threading

import posix_ipc

from mtpserve.config import IpcConfig
from mtpserve.ipc import sysv, wire
from mtpserve.ipc.frame_assembler import FrameAssembler, ReaderStats
from mtpserve.ipc.output_channel import OutputChannel
from mtpserve.ipc.seq_tracker import SeqTracker
from mtpserve.ipc.token_frame import Frame

_STOP_MTYPE = 2  # the reader's own wake-up message on close (frames use mtype 1)


class EngineDead(RuntimeError):
    """The output channel is gone: no frame will arrive."""


class OutputReader:
    """Reads one channel; `await get()` returns the next frame in order."""

    def __init__(self, channel: OutputChannel, *, vocab_size: int | None = None,
                 track_seq: bool = True, liveness_interval: float = IpcConfig.liveness_interval,
                 max_buffered: int = IpcConfig.reader_max_buffered) -> None:
        """Defaults are the configuration's [ipc] ones (config/schema.py)."""
        self.channel = channel
        self.tracker = SeqTracker() if track_seq else None
        self._assembler = FrameAssembler(channel.address.instance_tag, channel.ring,
                                         vocab_size=vocab_size, tracker=self.tracker)
        self._liveness_interval = liveness_interval
        self._frames: asyncio.Queue[Frame | None] = asyncio.Queue()
        self.dead_reason: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._mq: posix_ipc.MessageQueue | None = None
        self._thread: threading.Thread | None = None
        self._closing = False
        self._liveness: asyncio.TimerHandle | None = None
        self._max_buffered = max_buffered
        self._paused = False  # POSIX: descriptor unregistered while max_buffered frames wait
        self._slots = threading.Semaphore(max_buffered)  # SysV: frames the thread may hand over

    @property
    def max_buffered(self) -> int:
        """Decoded frames held for get() at most before the reader stops receiving."""
        return self._max_buffered

    @property
    def liveness_interval(self) -> float:
        """Seconds between checks that the channel still exists."""
        return self._liveness_interval

    @property
    def stats(self) -> ReaderStats:
        return self._assembler.stats

    @property
    def _event_loop(self) -> asyncio.AbstractEventLoop:
        """The loop `start` ran on (every callback of the reader runs there)."""
        assert self._loop is not None, "OutputReader used before start()"
        return self._loop

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        if self.channel.address.transport is wire.Transport.POSIX:
            self._start_posix()
        else:
            self._start_sysv()
        self._liveness = self._event_loop.call_later(self._liveness_interval, self._check_alive)

    async def get(self) -> Frame:
        """The next frame; raises EngineDead once the channel is gone and all frames are read."""
        frame = await self._frames.get()
        if frame is None:
            self._frames.put_nowait(None)  # every later get() raises too
            raise EngineDead(self.dead_reason or "output channel closed")
        if self._thread is not None:
            self._slots.release()
        if self._paused:
            self._resume_posix()
        return frame

    async def close(self) -> None:
        self._closing = True
        if self._liveness:
            self._liveness.cancel()
        if self._mq is not None:
            self._event_loop.remove_reader(self._mq.mqd)
            self._mq.close()
            self._mq = None
        if self._thread is not None:
            for _ in range(self._max_buffered):  # a thread waiting for a slot wakes and sees closing
                self._slots.release()
            await self._stop_thread()

    # POSIX ---------------------------------------------------------------------------------
    def _start_posix(self) -> None:
        self._mq = mq = posix_ipc.MessageQueue(self.channel.address.queue_name, read=True, write=False)
        mq.block = False
        self._event_loop.add_reader(mq.mqd, self._drain_posix)

    def _drain_posix(self) -> None:
        while (mq := self._mq) is not None:
            if self._frames.qsize() >= self._max_buffered:
                self._event_loop.remove_reader(mq.mqd)  # the queue fills: the engine sees it
                self._paused = True
                return
            try:
                message, _ = mq.receive()
            except posix_ipc.BusyError:
                return
            for frame in self._assembler.feed(message):
                self._frames.put_nowait(frame)

    def _resume_posix(self) -> None:
        mq = self._mq
        if mq is None or self._frames.qsize() >= self._max_buffered:
            return
        self._paused = False
        self._event_loop.add_reader(mq.mqd, self._drain_posix)
        self._drain_posix()

    # SysV ----------------------------------------------------------------------------------
    def _start_sysv(self) -> None:
        qid = sysv.open_existing(self.channel.address.sysv_key)
        receiver = sysv.Receiver(qid, self.channel.address.max_msg_bytes)
        self._thread = threading.Thread(target=self._sysv_loop, args=(receiver,),
                                        name="mtpserve-output-reader", daemon=True)
        self._thread.start()

    def _sysv_loop(self, receiver: sysv.Receiver) -> None:
        while True:
            try:
                received = receiver.recv()
            except OSError as e:
                reason = "output queue removed" if e.errno in (errno.EIDRM, errno.EINVAL) else str(e)
                self._event_loop.call_soon_threadsafe(self._mark_dead, reason)
                return
            assert received is not None  # NOTE: a blocking recv returns a message or raises
            mtype, body = received
            if mtype == _STOP_MTYPE and self._closing:
                return
            for frame in self._assembler.feed(body):
                self._slots.acquire()  # waits while max_buffered frames are unread
                if self._closing:
                    return
                self._event_loop.call_soon_threadsafe(self._frames.put_nowait, frame)

    async def _stop_thread(self) -> None:
        thread = self._thread
        assert thread is not None
        qid = sysv.find(self.channel.address.sysv_key)
        while qid is not None and thread.is_alive():
            if sysv.send(qid, b"", mtype=_STOP_MTYPE):
                break
            await asyncio.sleep(0.001)  # full queue: the thread is draining it
        await asyncio.to_thread(thread.join, 5.0)
        self._thread = None

    # both ----------------------------------------------------------------------------------
    def _check_alive(self) -> None:
        if self.dead_reason is not None or self._closing:
            return
        if self.channel.is_removed():
            self._mark_dead("output channel removed")
            return
        self._liveness = self._event_loop.call_later(self._liveness_interval, self._check_alive)

    def _mark_dead(self, reason: str) -> None:
        if self.dead_reason is not None:
            return
        self.dead_reason = reason
        if self._mq is not None:
            self._event_loop.remove_reader(self._mq.mqd)
        self._frames.put_nowait(None)
