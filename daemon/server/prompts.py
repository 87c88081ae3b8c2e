"""Prompts to token ids: completions prompts (text, texts, ids, lists of ids) and chat messages.

Long texts are tokenized off the event loop (the tokenizer releases the GIL in batch calls).
"""

from __future__ import annotations

import asyncio
from typing import NamedTuple

from mtpserve.web.errors import bad_request
from mtpserve.server.sampling import RequestLimits, check_prompt_ids
from mtpserve.server.schema import ChatMessage, PromptField, message_text
from mtpserve.server.text_model import ChatTemplateError, TextModel

OFFLOAD_CHARS = 8192  # tokenizing this much text takes long enough to block other requests


class Prompts(NamedTuple):
    token_ids: list[list[int]]  # [num_prompts][prompt_len]
    texts: list[str]  # [num_prompts] prompt text (for echo)


def split_prompt(prompt: PromptField, limits: RequestLimits) -> tuple[list[str], list[list[int]]]:
    """Tell the four accepted prompt shapes apart: (texts, token id lists), one of them empty;
    anything else is a 400 on `prompt`."""
    texts: list[str] = []
    ids: list[list[int]] = []
    if isinstance(prompt, str):
        texts = [prompt]
    elif not prompt:
        raise bad_request("The prompt is empty.", "prompt", "empty_prompt")
    elif all(isinstance(p, str) for p in prompt):
        texts = [p for p in prompt if isinstance(p, str)]
    elif all(isinstance(p, int) for p in prompt):
        ids = [[p for p in prompt if isinstance(p, int)]]
    elif all(isinstance(p, list) for p in prompt):
        ids = [p for p in prompt if isinstance(p, list)]
    else:
        raise bad_request("`prompt` must be a string, a list of strings, a list of token ids or a list of "
                          "lists of token ids.", "prompt")
    if len(texts) + len(ids) > limits.max_prompts:
        raise bad_request(f"At most {limits.max_prompts} prompts per request.", "prompt")
    return texts, ids


async def tokenize_prompts(prompt: PromptField, text: TextModel, limits: RequestLimits,
                           add_special_tokens: bool = True) -> Prompts:
    texts, ids = split_prompt(prompt, limits)
    if texts:
        if any(not p for p in texts):
            raise bad_request("The prompt is empty.", "prompt", "empty_prompt")
        ids = await _encode(text, texts, add_special_tokens)
    for one in ids:
        check_prompt_ids(one, limits, "prompt")
    return Prompts(ids, texts or [text.decode(one, skip_special_tokens=False) for one in ids])


async def tokenize_chat(messages: list[ChatMessage], add_generation_prompt: bool, text: TextModel,
                        limits: RequestLimits) -> list[int]:
    if not messages:
        raise bad_request("`messages` must not be empty.", "messages")
    plain = [{"role": m.role, "content": message_text(m), **({"name": m.name} if m.name else {})}
             for m in messages]
    try:
        rendered = text.render_chat(plain, add_generation_prompt)
    except ChatTemplateError as exc:
        raise bad_request(str(exc), "messages") from None
    [ids] = await _encode(text, [rendered], add_special_tokens=False)
    check_prompt_ids(ids, limits, "messages")
    return ids


async def _encode(text: TextModel, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
    if sum(map(len, texts)) < OFFLOAD_CHARS:
        return text.encode_batch(texts, add_special_tokens)
    return await asyncio.to_thread(text.encode_batch, texts, add_special_tokens)
