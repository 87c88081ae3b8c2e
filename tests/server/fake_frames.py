"""The fake engine's side of the real output path: wire frames (ipc/wire_encode.py, the reference
encoder the C++ packer is tested against) sent on the instance's POSIX queue.

A step is split into as many frames as it takes for each to fit one stock queue message (8192 B),
so no ring writer is needed; a full queue is waited on (back-pressure), never dropped. Both
transports: POSIX (posix_ipc) and SysV (ipc/sysv.py), whichever the channel was created with.
"""

from __future__ import annotations

import asyncio
from typing import NamedTuple

import numpy as np
import posix_ipc

from mtpserve.ipc import sysv, wire
from mtpserve.ipc.output_channel import OutputChannel
from mtpserve.ipc.wire_encode import encode_token_frame

FINISH_CODES = {None: wire.Finish.RUNNING, "stop": wire.Finish.STOP, "length": wire.Finish.LENGTH,
                "abort": wire.Finish.ABORT}


class OutputRow(NamedTuple):
    request_id: int
    seq: int  # tokens of this request sent before
    token_ids: list[int]
    wants_logprobs: bool
    finish_reason: str | None


class FrameSink:
    def __init__(self, instance: str, vocab_size: int) -> None:
        self.channel = OutputChannel.attach(instance)
        self.vocab_size = vocab_size
        self.instance = instance
        address = self.channel.address
        self._is_posix = address.transport is wire.Transport.POSIX
        self._mq = posix_ipc.MessageQueue(address.queue_name, read=False, write=True) if self._is_posix else None
        self._qid = None if self._is_posix else sysv.open_existing(address.sysv_key)
        self._max_bytes = self.channel.address.max_msg_bytes
        self._frame_seq = 0

    async def send(self, rows: list[OutputRow], step_id: int, top_width: int) -> None:
        for group in self._groups(rows, top_width):
            await self._send_one(self._encode(group, step_id, top_width))

    def _groups(self, rows: list[OutputRow], top_width: int) -> list[list[OutputRow]]:
        budget = self._max_bytes - wire.HEADER_SIZE - 10 * wire.SECTION_ALIGN
        groups, size = [[]], 0
        for row in rows:
            cost = 24 + len(row.token_ids) * (4 + 12 + 8 * top_width)
            if groups[-1] and size + cost > budget:
                groups.append([])
                size = 0
            groups[-1].append(row)
            size += cost
        return groups

    def _encode(self, rows: list[OutputRow], step_id: int, top_width: int) -> bytes:
        with_lp = any(r.wants_logprobs for r in rows)
        tokens = [t for r in rows for t in r.token_ids]
        frame = encode_token_frame(
            wire.Kind.TARGET, req_ids=[r.request_id for r in rows], seq=[r.seq for r in rows],
            num_tokens=[len(r.token_ids) for r in rows], finish=[FINISH_CODES[r.finish_reason] for r in rows],
            token_ids=tokens, step_id=step_id, frame_seq=self._frame_seq,
            instance_tag=self.channel.address.instance_tag,
            **(_logprob_arrays(rows, top_width, self.vocab_size) if with_lp else {}))
        self._frame_seq += 1
        return frame

    async def _send_one(self, frame: bytes) -> None:
        while not self._try_send(frame):
            await asyncio.sleep(0.001)  # the reader is behind: wait, never drop

    def _try_send(self, frame: bytes) -> bool:
        if not self._is_posix:
            assert self._qid is not None
            return sysv.send(self._qid, frame)
        assert self._mq is not None
        try:
            self._mq.send(frame, timeout=0)
            return True
        except posix_ipc.BusyError:
            return False

    def close(self) -> None:
        if self._mq is not None:
            self._mq.close()
        self.channel.close()


def _logprob_arrays(rows: list[OutputRow], top_width: int, vocab_size: int) -> dict:
    from fake_engine import fake_logprob, fake_top  # every row gets entries once any row asked

    tokens = [t for r in rows for t in r.token_ids]
    tops = [fake_top(t, top_width, vocab_size) for t in tokens]
    return dict(logprob=np.array([fake_logprob(t) for t in tokens], np.float32),
                rank=np.ones(len(tokens), np.int32),
                topk_ids=np.array([t[0] for t in tops], np.int32).reshape(len(tokens), top_width),
                topk_logprobs=np.array([t[1] for t in tops], np.float32).reshape(len(tokens), top_width))
