"""What the HTTP process consumes from the output path: per-request token deltas, one batch per step.

The output reader (ipc/, written by the output-path work) is adapted to `OutputSource` by
engine_client.py; a fake engine in tests speaks the same transports.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

FINISH_REASONS = ("stop", "length", "abort")


class TokenDelta(NamedTuple):
    """Tokens one engine step emitted for one request (several under MTP: accepted drafts + bonus)."""

    request_id: int
    token_ids: list[int]  # [T]
    logprobs: list[float] | None = None  # [T] logprob of each emitted token (None: not asked)
    top_ids: list[list[int]] | None = None  # [T][K] top-k token ids per emitted token
    top_logprobs: list[list[float]] | None = None  # [T][K]
    finish_reason: str | None = None  # one of FINISH_REASONS on the request's last delta


class OutputClosed(ConnectionError):
    """The engine side of the output path is gone."""


class OutputSource(Protocol):
    async def next_batch(self) -> list[TokenDelta]:
        """The next step's deltas; raises OutputClosed when the engine is gone."""

    async def close(self) -> None: ...
