"""One non-streamed answer from the prefill's 1-token body and the decode's body for the rest.

Per choice (matched by `index`): texts concatenated; completions logprobs lists concatenated with the
decode's `text_offset`s shifted to start at the prefill text's length; chat `logprobs.content` concatenated.
`finish_reason` and `usage` come from the decode (its usage counts the first token too), `id`,
`object`, `created` and `model` from the prefill.
"""

from __future__ import annotations

COMPLETION_LISTS = ("tokens", "token_logprobs", "top_logprobs")


def merge_bodies(prefill: dict, decode: dict) -> dict:
    decoded = {c.get("index"): c for c in decode.get("choices") or []}
    choices = [_merge_choice(c, decoded.get(c.get("index"))) for c in prefill.get("choices") or []]
    return {**decode, **_head(prefill), "choices": choices}


def _head(body: dict) -> dict:
    return {k: body[k] for k in ("id", "object", "created", "model") if k in body}


def _merge_choice(first: dict, rest: dict | None) -> dict:
    if rest is None:
        return first
    if "message" in first:
        return _merge_chat(first, rest)
    return _merge_completion(first, rest)


def _merge_completion(first: dict, rest: dict) -> dict:
    text = first.get("text") or ""
    logprobs = _cat_completion_logprobs(first.get("logprobs"), rest.get("logprobs"), len(text))
    return {**rest, "index": first.get("index"), "text": text + (rest.get("text") or ""), "logprobs": logprobs}


def _cat_completion_logprobs(first: dict | None, rest: dict | None, text_len: int) -> dict | None:
    if first is None or rest is None:
        return first or rest
    merged = {k: (first.get(k) or []) + (rest.get(k) or []) for k in COMPLETION_LISTS}
    offsets = rest.get("text_offset") or []
    shift = text_len - offsets[0] if offsets else 0  # NOTE: whatever base the decode counted from
    merged["text_offset"] = (first.get("text_offset") or []) + [o + shift for o in offsets]
    return merged


def _merge_chat(first: dict, rest: dict) -> dict:
    head, tail = first.get("message") or {}, rest.get("message") or {}
    content = (head.get("content") or "") + (tail.get("content") or "")
    return {**rest, "index": first.get("index"), "message": {**head, **tail, "content": content},
            "logprobs": _cat_chat_logprobs(first.get("logprobs"), rest.get("logprobs"))}


def _cat_chat_logprobs(first: dict | None, rest: dict | None) -> dict | None:
    if first is None or rest is None:
        return first or rest
    return {**rest, "content": (first.get("content") or []) + (rest.get("content") or [])}
