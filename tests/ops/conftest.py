"""Fixtures for the output ops: real channels, real senders, nothing left behind."""

import os
import sys
import uuid
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "ipc"))  # wire_strategies

from mtpserve import ops  # noqa: E402
from mtpserve.ipc.output_channel import OutputChannel  # noqa: E402
from wire_strategies import VOCAB  # noqa: E402


@pytest.fixture
def open_channel():
    """open_channel(transport, chunked, **kw) -> (channel, sender); removed at teardown."""
    made = []

    def make(transport: str, chunked: bool = False, *, max_pending_bytes: int = 64 << 20,
             rank: int = 0, **kw):
        instance = f"op{os.getpid()}-{uuid.uuid4().hex[:8]}"
        ch = OutputChannel.create(instance, transport, chunked=chunked, **kw)
        sender = ops.OutputSender(ch.address, rank=rank, vocab_size=VOCAB,
                                  max_pending_bytes=max_pending_bytes)
        made.append((ch, sender))
        return ch, sender

    yield make
    for ch, sender in made:
        sender.close()
        ch.remove()
