"""One choice of one HTTP request = one engine request: its text, tokens, logprobs and timings.

`apply` takes the deltas that arrived since the last call (coalesced: a slow client gets fewer,
larger chunks) and returns what to send. A stop string cuts the tokens after the one that completed
it, so logprob entries and usage always count the same tokens the text came from.

PD (docs/pd.md): a prefill choice (`hold_kv`) whose one token ends with LENGTH `continues` on a decode
instance: its update shows no finish and nothing held back is flushed (an incomplete character or a
possible stop-string start stays unsent). The decode choice is `prime`d with that token, so its
detokenizer and stop matcher hold the same tail and send it once it is complete (or cut it).
"""

from __future__ import annotations

from dataclasses import dataclass

import time
from typing import NamedTuple

from mtpserve.server.detokenizer import IncrementalDetokenizer
from mtpserve.web.errors import ApiError
from mtpserve.server.metrics import ServerMetrics
from mtpserve.server.outputs import TokenDelta
from mtpserve.server.stop_strings import StopStringMatcher


@dataclass(frozen=True, slots=True)
class ChoiceUpdate:
    index: int
    text: str
    token_ids: list[int]  # [T] tokens this update accounts for
    logprobs: list[float] | None  # [T]
    top_ids: list[list[int]] | None  # [T][K]
    top_logprobs: list[list[float]] | None  # [T][K]
    finish_reason: str | None


class Timed(NamedTuple):
    arrived: float  # time.monotonic() when the output reader handed the delta over
    delta: TokenDelta


class ChoiceState:
    def __init__(self, index: int, engine_id: int, detokenizer: IncrementalDetokenizer,
                 stops: StopStringMatcher, top_width: int | None, metrics: ServerMetrics, arrival: float,
                 hold_kv: bool = False) -> None:
        """top_width: top-k entries per token to return; None when the request asked for no logprobs.
        hold_kv: PD prefill; a LENGTH finish of the first token means the request continues elsewhere."""
        self.index, self.engine_id = index, engine_id
        self._detok, self._stop = detokenizer, stops
        self._top_width, self._metrics = top_width, metrics
        self.arrival = arrival  # time.monotonic() at HTTP arrival
        self.first_token_at: float | None = None
        self._last_at = arrival
        self.num_tokens = 0
        self.num_steps = 0  # engine outputs seen (prefill + each decode step)
        self.num_generated = 0  # tokens the engine sent, including any cut by a stop string
        self.num_cached_tokens = 0  # prompt tokens whose KV came from the prefix cache (PrefixHits)
        self.finish_reason: str | None = None
        self.stopped_by_string = False
        self.hold_kv = hold_kv
        self.continues = False  # PD prefill: finished here, continued by a decode instance
        self.first_token_id: int | None = None
        self.draft_ids: list[int] | None = None  # PD prefill: the MTP drafts after the first token
        self.prior_text = ""  # PD decode: text of the first token, sent by the prefill instance

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def apply(self, items: list[Timed]) -> ChoiceUpdate | None:
        if self.finished or not items:
            return None
        self._observe_timing(items)
        merged = _merge([item.delta for item in items])
        if merged.finish_reason == "error":
            self._finish("abort")
            raise ApiError(500, "The engine failed while generating this request.", code="engine_error")
        self._note_first(merged)
        text, keep = self._text_and_kept(merged.token_ids)
        finish = "stop" if self._stop.hit else merged.finish_reason
        self.continues = finish == "length" and self.hold_kv
        if finish is not None and not self._stop.hit and not self.continues:
            text += self._stop.feed(self._detok.flush()) + self._stop.flush()
        self.num_tokens += keep
        if finish is not None:
            self._finish(finish)
        return self._update(merged, text, keep, None if self.continues else finish)

    def prime(self, first_token_id: int) -> None:
        """PD decode: the prefill instance generated (and the router sent) the first token. Count it
        and feed it to the detokenizer and stop strings; its text (`prior_text`) is not sent again
        (`stopped_by_string` tells whether it already completed a stop string)."""
        self.first_token_id = first_token_id
        self.prior_text, _ = self._text_and_kept([first_token_id])
        self.num_tokens = self.num_generated = self.num_steps = 1
        self.first_token_at = self._last_at = self.arrival

    def abort(self) -> None:
        """The HTTP side gave up on this choice (client gone, stream error)."""
        if not self.finished:
            self._finish("abort")

    def _note_first(self, merged: TokenDelta) -> None:
        if self.first_token_id is None and merged.token_ids:
            self.first_token_id, self.draft_ids = merged.token_ids[0], merged.draft_ids

    def _text_and_kept(self, token_ids: list[int]) -> tuple[str, int]:
        mark = self._detok.mark()
        shown = self._stop.feed(self._detok.push(token_ids))
        if self._stop.hit is None:
            return shown, len(token_ids)
        self.stopped_by_string = True
        self._detok.rewind(mark)
        return shown, _tokens_through(self._detok.push_each(token_ids), self._stop.hit.end_in_fed)

    def _update(self, merged: TokenDelta, text: str, keep: int, finish: str | None) -> ChoiceUpdate:
        width = self._top_width
        if width is None:  # NOTE: a frame carries logprobs for all its rows if any row asked
            return ChoiceUpdate(self.index, text, merged.token_ids[:keep], None, None, None, finish)
        top_ids = [row[:width] for row in merged.top_ids[:keep]] if merged.top_ids is not None else None
        top_lps = [row[:width] for row in merged.top_logprobs[:keep]] if merged.top_logprobs is not None else None
        logprobs = merged.logprobs[:keep] if merged.logprobs is not None else None
        return ChoiceUpdate(self.index, text, merged.token_ids[:keep], logprobs, top_ids, top_lps, finish)

    def _observe_timing(self, items: list[Timed]) -> None:
        for item in items:  # NOTE: one item per engine step, not per token
            if not item.delta.token_ids:
                continue  # a bare finish (abort, length at a step boundary) is not a step of this request
            if self.first_token_at is None:
                self.first_token_at = item.arrived
                self._metrics.ttft.observe(item.arrived - self.arrival)
            else:
                self._metrics.itl.observe(item.arrived - self._last_at)
            self._last_at = item.arrived
            self.num_steps += 1
            self.num_generated += len(item.delta.token_ids)
            self._metrics.generation_tokens.inc(len(item.delta.token_ids))

    def _finish(self, reason: str) -> None:
        self.finish_reason = reason
        now = time.monotonic()
        self._metrics.e2e.observe(now - self.arrival)
        if self.first_token_at is not None and self.num_tokens > 1:
            self._metrics.tpot.observe((self._last_at - self.first_token_at) / (self.num_tokens - 1))
        self._metrics.finished(reason)


def _merge(deltas: list[TokenDelta]) -> TokenDelta:
    if len(deltas) == 1:
        return deltas[0]
    first = deltas[0]
    return TokenDelta(
        first.request_id,
        [t for d in deltas for t in d.token_ids],
        None if first.logprobs is None else [x for d in deltas for x in d.logprobs or ()],
        None if first.top_ids is None else [r for d in deltas for r in d.top_ids or ()],
        None if first.top_logprobs is None else [r for d in deltas for r in d.top_logprobs or ()],
        next((d.finish_reason for d in deltas if d.finish_reason is not None), None),
        next((d.draft_ids for d in deltas if d.draft_ids is not None), None),
    )


def _tokens_through(texts: list[str], end: int) -> int:
    """How many tokens it takes for their texts to reach `end` characters (at least one)."""
    total = 0
    for count, text in enumerate(texts, start=1):
        total += len(text)
        if total >= end:
            return count
    return len(texts)
