"""`/v1/completions` response and chunk objects (`object: "text_completion"`)."""

from __future__ import annotations

import time
import uuid

from mtpserve.server.choice import ChoiceUpdate
from mtpserve.server.detokenizer import TokenTextCache
from mtpserve.server.logprobs import completion_logprobs


class CompletionFormat:
    def __init__(self, model: str, cache: TokenTextCache, echo_texts: list[str] | None, n: int,
                 response_id: str | None = None, text_offsets: dict[int, int] | None = None) -> None:
        """text_offsets: choice index -> characters already sent elsewhere (PD decode: the first token)."""
        self._head = {"id": response_id or f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
                      "created": int(time.time()), "model": model}
        self._cache = cache
        self._echo = echo_texts  # [num_prompts] prompt texts when `echo`
        self._n = n
        self._offsets: dict[int, int] = dict(text_offsets or {})  # choice index -> text length sent so far

    @property
    def response_id(self) -> str:
        return self._head["id"]

    def opening_chunks(self) -> list[dict]:
        if not self._echo:
            return []
        num_choices = len(self._echo) * self._n
        return [self._wrap(self._choice(i, self._echo[i // self._n], None, None)) for i in range(num_choices)]

    def chunk(self, update: ChoiceUpdate) -> dict:
        return self._wrap(self._from_update(update))

    def usage_chunk(self, usage: dict) -> dict:
        return {**self._head, "choices": [], "usage": usage}

    def body(self, updates: list[ChoiceUpdate], usage: dict) -> dict:
        if self._echo:
            for update in updates:
                self._offsets[update.index] = len(self._echo[update.index // self._n])
        choices = [self._from_update(u) for u in updates]
        if self._echo:
            for choice in choices:
                choice["text"] = self._echo[choice["index"] // self._n] + choice["text"]
        return {**self._head, "choices": choices, "usage": usage}

    def _from_update(self, update: ChoiceUpdate) -> dict:
        offset = self._offsets.get(update.index, 0)
        logprobs = completion_logprobs(update, self._cache, offset)
        self._offsets[update.index] = offset + len(update.text)
        return self._choice(update.index, update.text, logprobs, update.finish_reason)

    def _wrap(self, choice: dict) -> dict:
        return {**self._head, "choices": [choice]}

    @staticmethod
    def _choice(index: int, text: str, logprobs: dict | None, finish_reason: str | None) -> dict:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
