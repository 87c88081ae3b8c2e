"""The model's text side, as the HTTP process needs it: mtpserve.tokenizer + mtpserve.chat_template
(both paddle-free), plus the batched one-id-per-string decode the logprob entries use."""

from __future__ import annotations

from pathlib import Path

from mtpserve.chat_template import ChatTemplate, ChatTemplateError
from mtpserve.tokenizer import Tokenizer

__all__ = ["ChatTemplateError", "TextModel"]


class TextModel:
    def __init__(self, tokenizer: Tokenizer, template: ChatTemplate | None) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.vocab_size
        self._template = template

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> TextModel:
        return cls(Tokenizer.from_model_dir(model_dir), ChatTemplate.from_model_dir(model_dir))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens)

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        return self.tokenizer.encode_batch(texts, add_special_tokens)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens)

    def decode_each(self, ids: list[int]) -> list[str]:
        """One string per id, in one batched call (logprob entries show special tokens too)."""
        return self.tokenizer.inner.decode_batch([[i] for i in ids], skip_special_tokens=False)

    def token_to_id(self, token: str) -> int | None:
        return self.tokenizer.inner.token_to_id(token)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if self._template is None:
            raise ChatTemplateError("This model has no chat template; use /v1/completions.")
        return self._template.render(messages, add_generation_prompt)
