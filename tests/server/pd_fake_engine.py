"""The fake engine (fake_engine.py) playing a PD role, run in the test's own process so that tests can
read what it received (`received`) and choose when KVHeld goes out.

Prefill role: a request whose one token ends with LENGTH and that asked for `hold_kv` keeps "blocks"
(`held`), reported by KVHeld before (or, with `held_after_frame`, after) its FIRST_TOKEN frame; every
one-token row goes out as a FIRST_TOKEN frame carrying k drafts (the prompt's next tokens, the fake's
generation rule). ReleaseKV frees held ids. Decode role: a request with `remote_prefill` starts with
output_ids = [first_token_id], so its frames carry the tokens after it from seq 1 on.
"""

from __future__ import annotations

import argparse
import asyncio
import math

import numpy as np

from fake_engine import BLOCK_SIZE, NUM_BLOCKS, FakeEngine, FakeRequest
from fake_frames import FINISH_CODES, FrameSink, OutputRow, _logprob_arrays
from mtpserve.ipc import wire
from mtpserve.ipc.request_channel import (
    AddRequest, EngineReady, KVHeld, KVLayout, ReleaseKV, RequestChannelServer, ResetPrefixCache,
)
from mtpserve.ipc.wire_encode import encode_token_frame

KV_SESSION = "127.0.0.1:17777"
KV_LAYOUT = KVLayout(block_size=BLOCK_SIZE, buffer_addrs=[1 << 32, 2 << 32, 3 << 32, 4 << 32],
                     block_bytes=[4096, 4096, 2048, 2048])
LEASE_S = 30.0


class PdFrameSink(FrameSink):
    """Rows of requests in `drafts` go out as one FIRST_TOKEN frame with their drafts."""

    def __init__(self, instance: str, vocab_size: int) -> None:
        super().__init__(instance, vocab_size)
        self.drafts: dict[int, list[int]] = {}  # request id -> its k drafts (prefill role)

    async def send(self, rows: list[OutputRow], step_id: int, top_width: int) -> None:
        first = [r for r in rows if r.request_id in self.drafts]
        rest = [r for r in rows if r.request_id not in self.drafts]
        if rest:
            await super().send(rest, step_id, top_width)
        if first:
            await self._send_one(self._encode_first(first, step_id, top_width))

    def _encode_first(self, rows: list[OutputRow], step_id: int, top_width: int) -> bytes:
        drafts = np.array([self.drafts.pop(r.request_id) for r in rows], np.int32).reshape(len(rows), -1)
        with_lp = any(r.wants_logprobs for r in rows)
        frame = encode_token_frame(
            wire.Kind.FIRST_TOKEN, req_ids=[r.request_id for r in rows], seq=[r.seq for r in rows],
            num_tokens=[len(r.token_ids) for r in rows], finish=[FINISH_CODES[r.finish_reason] for r in rows],
            token_ids=[t for r in rows for t in r.token_ids], step_id=step_id, frame_seq=self._frame_seq,
            instance_tag=self.channel.address.instance_tag, draft_ids=drafts if drafts.shape[1] else None,
            **(_logprob_arrays(rows, top_width, self.vocab_size) if with_lp else {}))
        self._frame_seq += 1
        return frame


class PdFakeEngine(FakeEngine):
    def __init__(self, server: RequestChannelServer, sink: PdFrameSink, args: argparse.Namespace,
                 role: str) -> None:
        super().__init__(server, sink, args)
        self.sink: PdFrameSink = sink
        self.role = role
        self.received: list = []  # every request-channel message, in order
        self.held: dict[int, list[int]] = {}  # request id -> block ids (prefill role)
        self.held_after_frame = False  # send KVHeld after the FIRST_TOKEN frame instead of before
        self._next_block = 100

    def ready(self) -> EngineReady:
        pd = self.role != "mixed"
        return EngineReady(model_name="fake", max_model_len=self.args.max_model_len, vocab_size=self.args.vocab_size,
                           eos_token_ids=[self.args.eos_id], num_speculative_tokens=self.args.k,
                           num_kv_blocks=NUM_BLOCKS, kv_block_size=BLOCK_SIZE, output_channel=self.sink.instance,
                           role=self.role, kv_session=KV_SESSION if pd else "", kv_layout=KV_LAYOUT if pd else None)

    def adds(self) -> list[AddRequest]:
        return [m for m in self.received if isinstance(m, AddRequest)]

    def released(self) -> list[int]:
        return [i for m in self.received if isinstance(m, ReleaseKV) for i in m.request_ids]

    def intake(self) -> None:
        messages = self.server.poll()
        self.received += messages
        for msg in messages:
            if isinstance(msg, AddRequest):
                self._add(msg)
            elif isinstance(msg, ReleaseKV):
                for rid in msg.request_ids:
                    self.held.pop(rid, None)
            elif isinstance(msg, ResetPrefixCache):
                self.reset_prefix_cache(msg)
            else:
                for rid in msg.request_ids:
                    self.running.pop(rid, None)

    def _add(self, msg: AddRequest) -> None:
        req = FakeRequest(msg)
        if msg.remote_prefill is not None:
            req.generated, req.steps = [msg.remote_prefill.first_token_id], 1
        self.running[msg.request_id] = req

    def _advance(self, req: FakeRequest) -> OutputRow:
        row = super()._advance(req)
        if self.role == "prefill" and len(req.generated) == 1:
            prompt = req.add.prompt_token_ids
            self.sink.drafts[row.request_id] = [prompt[(1 + j) % len(prompt)] for j in range(self.args.k)]
            if req.add.hold_kv and row.finish_reason == "length":
                self._hold(req)
        return row

    def _hold(self, req: FakeRequest) -> None:
        num_tokens = len(req.add.prompt_token_ids)
        blocks = list(range(self._next_block, self._next_block + math.ceil(num_tokens / BLOCK_SIZE)))
        self._next_block += len(blocks)
        self.held[req.add.request_id] = blocks
        msg = KVHeld(request_id=req.add.request_id, block_ids=blocks, num_tokens=num_tokens,
                     lease_expires_in=LEASE_S, mtp_key_start=fake_key_start(num_tokens))
        if self.held_after_frame:
            asyncio.get_running_loop().call_later(0.05, self.server.send, msg)
        else:
            self.server.send(msg)


def fake_key_start(num_tokens: int) -> int:
    """The fake prefill's key start: its prompt's last block (as a one-position window has it)."""
    return (num_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE


def fake_args(vocab_size: int, k: int = 2, step_ms: float = 2.0) -> argparse.Namespace:
    return argparse.Namespace(vocab_size=vocab_size, max_model_len=512, eos_id=0, k=k, step_ms=step_ms)
