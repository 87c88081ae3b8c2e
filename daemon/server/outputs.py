"""What the HTTP process consumes from the output path: per-request token deltas, one batch per step.

The output reader (ipc/output_reader.py) is adapted to `OutputSource` by output_source.py; a fake
engine in tests speaks the same transports.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

from mtpserve.ipc.frame_assembler import ReaderStats

FINISH_REASONS = ("stop", "length", "abort")


class TokenDelta(NamedTuple):
    """Tokens one engine step emitted for one request (several under MTP: accepted drafts + bonus)."""

    request_id: int
    token_ids: list[int]  # [T]
    logprobs: list[float] | None = None  # [T] logprob of each emitted token (None: not asked)
    top_ids: list[list[int]] | None = None  # [T][K] top-k token ids per emitted token
    top_logprobs: list[list[float]] | None = None  # [T][K]
    finish_reason: str | None = None  # one of FINISH_REASONS on the request's last delta
    draft_ids: list[int] | None = None  # FIRST_TOKEN frames (PD prefill): the k MTP drafts after the token


class OutputClosed(ConnectionError):
    """The engine side of the output path is gone."""


class OutputSource(Protocol):
    async def next_batch(self) -> list[TokenDelta]:
        """The next step's deltas; raises OutputClosed when the engine is gone."""
        ...

    def expect_seq(self, request_id: int, start: int) -> None:
        """The first frame of this request will carry `seq == start` (PD decode: the first token came
        from the prefill instance, so the engine starts at seq 1)."""
        ...

    def forget_seq(self, request_id: int) -> None:
        """No frame will finish this request (the engine refused it): stop tracking its seq."""
        ...

    def stats(self) -> ReaderStats:
        """The reader's cumulative counters: frames, bytes, rejects by reason, lost frames, seq errors."""
        ...

    async def close(self) -> None: ...
