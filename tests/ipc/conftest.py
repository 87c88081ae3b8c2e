"""Fixtures for the output-channel tests: unique instance names, nothing left behind."""

import os
import uuid

import pytest

from mtpserve.ipc.output_channel import OutputChannel


@pytest.fixture
def instance() -> str:
    return f"t{os.getpid()}-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def make_channel(instance):
    made: list[OutputChannel] = []

    def make(transport: str, **kw) -> OutputChannel:
        ch = OutputChannel.create(instance, transport, **kw)
        made.append(ch)
        return ch

    yield make
    for ch in made:
        ch.remove()
