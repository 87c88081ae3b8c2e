"""`/v1/chat/completions` response (`chat.completion`) and chunk (`chat.completion.chunk`) objects."""

from __future__ import annotations

import time
import uuid

from mtpserve.server.choice import ChoiceUpdate
from mtpserve.server.detokenizer import TokenTextCache
from mtpserve.server.logprobs import chat_logprobs


class ChatFormat:
    def __init__(self, model: str, cache: TokenTextCache, num_choices: int, response_id: str | None = None,
                 with_role: bool = True) -> None:
        """with_role: False when the stream continues one that already sent the role (PD decode)."""
        self._id = response_id or f"chatcmpl-{uuid.uuid4().hex}"
        self._with_role = with_role
        self._created = int(time.time())
        self._model = model
        self._cache = cache
        self._num_choices = num_choices

    @property
    def response_id(self) -> str:
        return self._id

    def _head(self, obj: str) -> dict:
        return {"id": self._id, "object": obj, "created": self._created, "model": self._model}

    def opening_chunks(self) -> list[dict]:
        """The first chunk of each choice carries the role (OpenAI's stream shape)."""
        if not self._with_role:
            return []
        return [self._chunk(i, {"role": "assistant", "content": ""}, None, None) for i in range(self._num_choices)]

    def chunk(self, update: ChoiceUpdate) -> dict:
        delta = {"content": update.text} if update.text or update.finish_reason is None else {}
        return self._chunk(update.index, delta, chat_logprobs(update, self._cache), update.finish_reason)

    def usage_chunk(self, usage: dict) -> dict:
        return {**self._head("chat.completion.chunk"), "choices": [], "usage": usage}

    def body(self, updates: list[ChoiceUpdate], usage: dict) -> dict:
        choices = [{"index": u.index, "message": {"role": "assistant", "content": u.text},
                    "logprobs": chat_logprobs(u, self._cache), "finish_reason": u.finish_reason}
                   for u in updates]
        return {**self._head("chat.completion"), "choices": choices, "usage": usage}

    def _chunk(self, index: int, delta: dict, logprobs: dict | None, finish_reason: str | None) -> dict:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        return {**self._head("chat.completion.chunk"), "choices": [choice]}
