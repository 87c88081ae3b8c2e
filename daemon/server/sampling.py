"""Value checks on a decoded body and its translation into the engine's SamplingParams.

Order: `check_fields` (ranges, no tokenizer needed) -> routes tokenize -> `check_prompt_ids` ->
`to_sampling_params` (which resolves max_tokens against the context window).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

from mtpserve.config import ServerConfig
from mtpserve.ipc.request_channel import SamplingParams
from mtpserve.web.errors import bad_request, context_too_long
from mtpserve.server.schema import ChatCompletionRequest, CompletionRequest, SamplingFields

_INT64_MAX = 2**63 - 1


@dataclass(frozen=True)
class RequestLimits:
    max_model_len: int
    vocab_size: int
    # NOTE: defaults are the configuration's [server] ones (config/schema.py); app.py passes the real values.
    max_n: int = ServerConfig.max_n
    max_stop_strings: int = ServerConfig.max_stop_strings
    max_stop_string_chars: int = 256
    max_prompts: int = ServerConfig.max_prompts_per_request
    max_top_logprobs: int = ServerConfig.max_top_logprobs


# NOTE: each predicate sees one field's value, whose type is that field's (Any: the table spans fields).
Check = tuple[str, Callable[[Any], bool], str]

# field, "is valid" predicate (None always passes), message
_RANGE_CHECKS: list[Check] = [
    ("max_tokens", lambda v: v >= 1, "must be at least 1"),
    ("max_completion_tokens", lambda v: v >= 1, "must be at least 1"),
    ("temperature", lambda v: 0.0 <= v <= 2.0, "must be in [0, 2]"),
    ("top_p", lambda v: 0.0 < v <= 1.0, "must be in (0, 1]"),
    ("top_k", lambda v: v >= -1, "must be -1 (disabled), 0 (disabled) or positive"),
    ("min_p", lambda v: 0.0 <= v <= 1.0, "must be in [0, 1]"),
    ("seed", lambda v: -_INT64_MAX - 1 <= v <= _INT64_MAX, "must fit in a signed 64-bit integer"),
    ("min_tokens", lambda v: v >= 0, "must be non-negative"),
    ("max_draft_tokens", lambda v: v >= 0, "must be non-negative (0 turns drafting off)"),
    ("presence_penalty", lambda v: -2.0 <= v <= 2.0, "must be in [-2, 2]"),
    ("frequency_penalty", lambda v: -2.0 <= v <= 2.0, "must be in [-2, 2]"),
    ("repetition_penalty", lambda v: 0.0 < v <= 10.0, "must be in (0, 10]"),
]


# field, "is it the default (or an equivalent)?" predicate
_UNSUPPORTED: list[tuple[str, Callable[[Any], bool]]] = [
    ("best_of", lambda v: v == 1),
    ("logit_bias", lambda v: not v),
    ("response_format", lambda v: v.get("type", "text") == "text"),
    ("prompt_logprobs", lambda v: False),
    ("tools", lambda v: not v),
    ("suffix", lambda v: not v),
]


def check_fields(req: SamplingFields, limits: RequestLimits) -> None:
    """Raise a 400 naming the first invalid field."""
    check_unsupported(req)
    for name, is_valid, message in _RANGE_CHECKS:
        value = getattr(req, name, None)
        if value is not None and (_is_nan(value) or not is_valid(value)):
            raise bad_request(f"`{name}` {message}, got {value}.", name, "invalid_value")
    _check_n(req, limits)
    _check_stop(req, limits)
    _check_logprobs(req, limits.max_top_logprobs)
    if req.stream_options is not None and not req.stream:
        raise bad_request("`stream_options` is only allowed when `stream` is true.", "stream_options")


def check_unsupported(req: SamplingFields) -> None:
    for name, is_default in _UNSUPPORTED:
        value = getattr(req, name, None)
        if value is not None and not is_default(value):
            raise bad_request(f"`{name}` is not supported by this server.", name, "unsupported_parameter")


def _is_nan(value: object) -> bool:
    return isinstance(value, float) and not math.isfinite(value)


def _check_n(req: SamplingFields, limits: RequestLimits) -> None:
    if req.n is not None and not 1 <= req.n <= limits.max_n:
        raise bad_request(f"`n` must be in [1, {limits.max_n}], got {req.n}.", "n", "invalid_value")


def _check_stop(req: SamplingFields, limits: RequestLimits) -> None:
    stops = stop_strings(req)
    if len(stops) > limits.max_stop_strings:
        raise bad_request(f"At most {limits.max_stop_strings} stop strings are allowed, got {len(stops)}.", "stop")
    if any(not s or len(s) > limits.max_stop_string_chars for s in stops):
        raise bad_request(f"Stop strings must be 1..{limits.max_stop_string_chars} characters long.", "stop")
    if any(not 0 <= t < limits.vocab_size for t in req.stop_token_ids or ()):
        raise bad_request(f"`stop_token_ids` must be in [0, {limits.vocab_size}).", "stop_token_ids")


def _check_logprobs(req: SamplingFields, max_top: int) -> None:
    if isinstance(req, CompletionRequest):
        if req.logprobs is not None and not 0 <= req.logprobs <= max_top:
            raise bad_request(f"`logprobs` must be in [0, {max_top}].", "logprobs", "invalid_value")
        if req.echo and req.logprobs is not None:
            raise bad_request("`echo` with `logprobs` (prompt logprobs) is not supported.", "echo")
        return
    assert isinstance(req, ChatCompletionRequest)
    if req.top_logprobs is not None:
        if not 0 <= req.top_logprobs <= max_top:
            raise bad_request(f"`top_logprobs` must be in [0, {max_top}].", "top_logprobs", "invalid_value")
        if not req.logprobs:
            raise bad_request("`top_logprobs` requires `logprobs` to be true.", "top_logprobs")


def stop_strings(req: SamplingFields) -> list[str]:
    if req.stop is None:
        return []
    return [req.stop] if isinstance(req.stop, str) else list(req.stop)


def text_options(req: SamplingFields) -> dict:
    """vLLM's detokenization extensions, as GenerateRequest keywords."""
    return dict(skip_special_tokens=req.skip_special_tokens is not False,
                include_stop_str=bool(req.include_stop_str_in_output))


def check_prompt_ids(ids: list[int], limits: RequestLimits, param: str) -> None:
    if not ids:
        raise bad_request("The prompt is empty.", param, "empty_prompt")
    if min(ids) < 0 or max(ids) >= limits.vocab_size:
        raise bad_request(f"Token ids must be in [0, {limits.vocab_size}).", param, "invalid_token_id")


def to_sampling_params(req: SamplingFields, num_prompt_tokens: int, limits: RequestLimits) -> SamplingParams:
    """Resolve defaults (completions: 16 tokens; chat: the rest of the context) and check the window."""
    max_tokens, param = _requested_max_tokens(req)
    room = limits.max_model_len - num_prompt_tokens
    if room < 1 or (max_tokens is not None and max_tokens > room):
        prompt_param = "messages" if isinstance(req, ChatCompletionRequest) else "prompt"
        raise context_too_long(num_prompt_tokens, max_tokens or 1, limits.max_model_len,
                               param if max_tokens and room >= 1 else prompt_param)
    max_tokens = max_tokens or (16 if isinstance(req, CompletionRequest) else room)
    min_tokens = req.min_tokens or 0
    if min_tokens > max_tokens:
        raise bad_request(f"`min_tokens` ({min_tokens}) exceeds the maximum tokens ({max_tokens}).", "min_tokens")
    return SamplingParams(
        max_tokens=max_tokens, min_tokens=min_tokens, **_sampling_knobs(req, limits.vocab_size),
        **_logprob_knobs(req))


def _requested_max_tokens(req: SamplingFields) -> tuple[int | None, str]:
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        return req.max_completion_tokens, "max_completion_tokens"
    return req.max_tokens, "max_tokens"


def _sampling_knobs(req: SamplingFields, vocab_size: int) -> dict:
    top_k = req.top_k if req.top_k is not None and 0 < req.top_k < vocab_size else 0  # >= vocab: no cut
    return dict(
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p, top_k=top_k,
        min_p=req.min_p or 0.0, seed=None if req.seed is None else req.seed % 2**64,
        presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=req.repetition_penalty or 1.0,
        stop_token_ids=tuple(req.stop_token_ids or ()), ignore_eos=bool(req.ignore_eos),
        max_draft_tokens=req.max_draft_tokens,
    )


def _logprob_knobs(req: SamplingFields) -> dict:
    if isinstance(req, CompletionRequest):
        return dict(logprobs=req.logprobs)
    assert isinstance(req, ChatCompletionRequest)
    return dict(logprobs=(req.top_logprobs or 0) if req.logprobs else None)
