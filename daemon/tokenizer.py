"""A model's tokenizer (`tokenizer.json` + the special tokens named in `tokenizer_config.json`).

Imported by the HTTP process and by the rank processes, so it must not import paddle.
"""

from __future__ import annotations

import json
from pathlib import Path

import tokenizers


class TokenizerMismatchError(ValueError):
    """The tokenizer produces ids the model has no embedding row for."""


class Tokenizer:
    def __init__(self, inner: tokenizers.Tokenizer, eos_token: str | None = None,
                 bos_token: str | None = None):
        self.inner = inner
        self.vocab_size = inner.get_vocab_size(with_added_tokens=True)
        self.eos_token_id = inner.token_to_id(eos_token) if eos_token else None
        self.bos_token_id = inner.token_to_id(bos_token) if bos_token else None

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> Tokenizer:
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.exists():
            raise FileNotFoundError(f"no tokenizer.json in {model_dir}")
        config_path = model_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.exists() else {}
        return cls(tokenizers.Tokenizer.from_file(str(path)), _token_text(config.get("eos_token")),
                   _token_text(config.get("bos_token")))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.inner.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        return [e.ids for e in self.inner.encode_batch(texts, add_special_tokens=add_special_tokens)]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)

    def check_vocab(self, model_vocab_size: int) -> None:
        """Fail unless every id this tokenizer can produce has a row in the model's embedding.

        A model may have more rows than the tokenizer (vocabularies are often padded), never fewer.
        """
        if self.vocab_size > model_vocab_size:
            raise TokenizerMismatchError(
                f"tokenizer has {self.vocab_size} tokens but the model's vocab_size is {model_vocab_size}")


def _token_text(value: str | dict | None) -> str | None:
    return value.get("content") if isinstance(value, dict) else value
