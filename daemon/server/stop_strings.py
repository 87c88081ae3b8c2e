"""Stop strings on streamed text, holding back a tail that might be the start of a stop string.

`feed(text)` returns what may be shown now; once a stop string completes, `hit` holds where the
match ends inside the fed text, and everything from the match on is withheld (OpenAI semantics:
the stop string itself is not returned, unless `include_stop` asks for it, as vLLM's
`include_stop_str_in_output` does).
"""

from __future__ import annotations

from typing import NamedTuple


class StopHit(NamedTuple):
    end_in_fed: int  # chars of the last fed text up to the end of the match
    stop: str


class StopStringMatcher:
    def __init__(self, stops: list[str], include_stop: bool = False) -> None:
        self.stops = stops
        self._include = include_stop
        self._max_len = max((len(s) for s in stops), default=0)
        self._pending = ""
        self.hit: StopHit | None = None

    def feed(self, text: str) -> str:
        """Text safe to emit now; sets `hit` when a stop string completes."""
        if not self.stops or self.hit is not None:
            return text if self.hit is None else ""
        buf = self._pending + text
        found = self._earliest_match(buf)
        if found is not None:
            start, stop = found
            self.hit = StopHit(start + len(stop) - len(self._pending), stop)
            self._pending = ""
            return buf[:start + len(stop)] if self._include else buf[:start]
        held = self._held_suffix_len(buf)
        self._pending = buf[len(buf) - held:] if held else ""
        return buf[:len(buf) - held]

    def flush(self) -> str:
        """At the end of the request the held tail was not a stop string after all."""
        text, self._pending = self._pending, ""
        return text

    def _earliest_match(self, buf: str) -> tuple[int, str] | None:
        found = [(i, s) for s in self.stops if (i := buf.find(s)) >= 0]
        return min(found) if found else None

    def _held_suffix_len(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of some stop string."""
        for size in range(min(self._max_len - 1, len(buf)), 0, -1):
            tail = buf[-size:]
            if any(s.startswith(tail) for s in self.stops):
                return size
        return 0
