"""Incremental detokenization: token ids arrive in deltas (several per step under MTP), text leaves.

Each delta costs two `decode` calls over a short window, whatever its token count: the window starts
at `prefix_offset` so that tokenizers whose pieces depend on their left neighbour (leading spaces,
byte-level BPE) decode the same as the whole text would, and text ending in an incomplete UTF-8
sequence ("\ufffd") is held until the bytes that complete it arrive.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

_REPLACEMENT = "\ufffd"


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...
    def decode_each(self, ids: list[int]) -> list[str]: ...


class _Offsets(NamedTuple):
    num_ids: int
    prefix_offset: int
    read_offset: int


class IncrementalDetokenizer:
    def __init__(self, decoder: Decoder, skip_special_tokens: bool = True) -> None:
        self._decoder = decoder
        self._skip = skip_special_tokens
        self.ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0

    def push(self, new_ids: list[int]) -> str:
        """Append ids; return the text they complete (maybe "", when bytes are still partial)."""
        self.ids.extend(new_ids)
        return self._advance(final=False)

    def push_each(self, new_ids: list[int]) -> list[str]:
        """Per-token texts (rare path: locating the token that completed a stop string)."""
        return [self.push([token_id]) for token_id in new_ids]

    def flush(self) -> str:
        """At the end: whatever is still held back, replacement characters included."""
        return self._advance(final=True)

    def mark(self) -> _Offsets:
        return _Offsets(len(self.ids), self._prefix_offset, self._read_offset)

    def rewind(self, mark: _Offsets) -> None:
        del self.ids[mark.num_ids:]
        self._prefix_offset, self._read_offset = mark.prefix_offset, mark.read_offset

    def _advance(self, final: bool) -> str:
        prefix_text = self._decode(self.ids[self._prefix_offset:self._read_offset])
        full_text = self._decode(self.ids[self._prefix_offset:])
        if len(full_text) <= len(prefix_text) or (full_text.endswith(_REPLACEMENT) and not final):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)
        return full_text[len(prefix_text):]

    def _decode(self, ids: list[int]) -> str:
        return self._decoder.decode(ids, skip_special_tokens=self._skip) if ids else ""


class TokenTextCache:
    """id -> its own text for logprob entries, decoded in batches and kept (the vocabulary is finite)."""

    def __init__(self, decoder: Decoder) -> None:
        self._decoder = decoder
        self._texts: dict[int, str] = {}

    def texts(self, ids: list[int]) -> list[str]:
        missing = list({i for i in ids if i not in self._texts})
        if missing:
            self._texts.update(zip(missing, self._decoder.decode_each(missing)))
        return [self._texts[i] for i in ids]
