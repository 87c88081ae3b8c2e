"""The model's text side, as the HTTP process needs it: tokenizer, chat template, special tokens.

NOTE: written against the `tokenizers` API directly until mtpserve.tokenizer / mtpserve.chat_template
(model helper) land; the surface the server uses is exactly the methods below.
"""

from __future__ import annotations

import json
from pathlib import Path

import jinja2
import jinja2.sandbox
import tokenizers


class ChatTemplateError(ValueError):
    """The template failed on these messages (a 400, not a 500)."""


class TextModel:
    def __init__(self, tokenizer: tokenizers.Tokenizer, chat_template: str | None,
                 special_tokens: dict[str, str]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self._template = _compile(chat_template) if chat_template else None
        self._special_tokens = special_tokens

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> TextModel:
        model_dir = Path(model_dir)
        tokenizer = tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        config_path = model_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.exists() else {}
        specials = {k: _token_text(config.get(k)) for k in ("bos_token", "eos_token") if config.get(k)}
        return cls(tokenizer, config.get("chat_template"), specials)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        return [e.ids for e in self.tokenizer.encode_batch(texts, add_special_tokens=add_special_tokens)]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def decode_each(self, ids: list[int]) -> list[str]:
        """One string per id, in one batched call (logprob entries)."""
        return self.tokenizer.decode_batch([[i] for i in ids], skip_special_tokens=False)

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if self._template is None:
            raise ChatTemplateError("This model has no chat template; use /v1/completions.")
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         **self._special_tokens)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"Chat template error: {exc}") from None


def _compile(source: str) -> jinja2.Template:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise
    return env.from_string(source)


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)


def _token_text(value: str | dict | None) -> str:
    return value.get("content", "") if isinstance(value, dict) else value or ""
