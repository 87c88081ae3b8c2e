"""A model's chat template (Jinja, from `tokenizer_config.json`), rendered in a sandbox.

The template comes with the checkpoint, so it is untrusted code: it runs in Jinja's immutable sandbox
(no attribute access to internals, no mutation of the messages passed in). Imported by the HTTP
process, so it must not import paddle.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jinja2
import jinja2.sandbox


class ChatTemplateError(ValueError):
    """The template is malformed or refused these messages (a client error, not a server error)."""


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str] | None = None):
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ChatTemplateError(f"chat template does not parse: {exc}") from None

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> ChatTemplate | None:
        """The template in `tokenizer_config.json`, or None when the model has none."""
        path = Path(model_dir) / "tokenizer_config.json"
        if not path.exists():
            return None
        config = json.loads(path.read_text())
        source = config.get("chat_template")
        if isinstance(source, list):  # the named-templates form: [{"name": ..., "template": ...}]
            source = next((t["template"] for t in source if t.get("name") == "default"), None)
        if not source:
            return None
        specials = {k: _token_text(config.get(k)) for k in ("bos_token", "eos_token") if config.get(k)}
        return cls(source, specials)

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               **extra: Any) -> str:
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         **self.special_tokens, **extra)
        except jinja2.TemplateError as exc:  # SecurityError is a TemplateError too
            raise ChatTemplateError(f"chat template error: {exc}") from None


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)


def _token_text(value: str | dict | None) -> str:
    return value.get("content", "") if isinstance(value, dict) else value or ""
