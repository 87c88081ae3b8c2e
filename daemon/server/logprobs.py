"""Logprob objects in OpenAI's two shapes: completions (parallel lists) and chat (one entry per token).

Every emitted token gets exactly one entry; token texts come from one batched decode per update.
"""

from __future__ import annotations

from mtpserve.server.choice import ChoiceUpdate
from mtpserve.server.detokenizer import TokenTextCache

MIN_LOGPROB = -9999.0  # JSON has no -inf; a masked token reports this floor (as vLLM does)


def _clamp(values: list[float]) -> list[float]:
    return [v if v > MIN_LOGPROB else MIN_LOGPROB for v in values]


def _all_ids(update: ChoiceUpdate) -> list[int]:
    return update.token_ids + [t for row in update.top_ids or () for t in row]


def completion_logprobs(update: ChoiceUpdate, cache: TokenTextCache, text_offset: int) -> dict | None:
    """`{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`; the sampled token is always in top."""
    if update.logprobs is None:
        return None
    texts = cache.texts(_all_ids(update))
    num = len(update.token_ids)
    tokens, lps = texts[:num], _clamp(update.logprobs)
    tops, pos = [], num
    for token, lp, row_ids, row_lps in zip(tokens, lps, update.top_ids or [[]] * num,
                                          update.top_logprobs or [[]] * num):
        top = dict(zip(texts[pos:pos + len(row_ids)], _clamp(row_lps)))
        top.setdefault(token, lp)
        tops.append(top)
        pos += len(row_ids)
    offsets, at = [], text_offset
    for token in tokens:
        offsets.append(at)
        at += len(token)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(update: ChoiceUpdate, cache: TokenTextCache) -> dict | None:
    """`{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}, ...]}`."""
    if update.logprobs is None:
        return None
    texts = cache.texts(_all_ids(update))
    num = len(update.token_ids)
    content, pos = [], num
    for token, lp, row_ids, row_lps in zip(texts[:num], _clamp(update.logprobs), update.top_ids or [[]] * num,
                                          update.top_logprobs or [[]] * num):
        top = [_entry(t, v) for t, v in zip(texts[pos:pos + len(row_ids)], _clamp(row_lps))]
        content.append({**_entry(token, lp), "top_logprobs": top})
        pos += len(row_ids)
    return {"content": content}


def _entry(token: str, logprob: float) -> dict:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}
