"""Request bodies as msgspec Structs, in OpenAI's field names plus vLLM's sampling extensions.

Decoding checks types (a wrong type is a 400 naming the field); value ranges are checked by
sampling.py, which also turns a body into the engine's SamplingParams.
"""

from __future__ import annotations

from typing import TypeVar, Literal, Union

import msgspec

from mtpserve.ipc.request_channel import KVLayout
from mtpserve.web.errors import from_decode_error


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class KVTransferParams(msgspec.Struct, kw_only=True):
    """What a prefill instance answered (docs/pd.md); a decode instance continues the request from it."""

    transfer_id: int
    kv_session: str
    kv_layout: KVLayout
    block_ids: list[int]
    prompt_token_ids: list[int]
    first_token_id: int
    draft_token_ids: list[int]
    lease_expires_in: float
    mtp_key_start: int | None = None  # absent from an older prefill: the decode side derives it


class SamplingFields(msgspec.Struct, kw_only=True):
    """Fields common to completions and chat (unknown extra fields are ignored, as OpenAI does)."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    n: int | None = None
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    skip_special_tokens: bool | None = None  # vLLM extension, default true
    include_stop_str_in_output: bool | None = None  # vLLM extension, default false
    max_draft_tokens: int | None = None  # mtpserve extension: cap this request's drafts (0: none)
    # Accepted so that a request using them is refused by name instead of silently served without
    # them (sampling.check_unsupported); unknown extra fields are ignored, as OpenAI does.
    best_of: int | None = None
    logit_bias: dict[str, float] | None = None
    response_format: dict | None = None
    prompt_logprobs: int | None = None
    tools: list | None = None
    kv_transfer_params: KVTransferParams | None = None  # PD: sent by the router to a decode instance


# NOTE: msgspec allows one array type per union, so list shapes are told apart in sampling.py.
PromptField = Union[str, list[Union[str, int, list[int]]]]


class CompletionRequest(SamplingFields, kw_only=True):
    prompt: PromptField
    logprobs: int | None = None
    echo: bool | None = None
    suffix: str | None = None


class TextPart(msgspec.Struct):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None
    name: str | None = None


class ChatCompletionRequest(SamplingFields, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    add_generation_prompt: bool = True


class TokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    tokens: list[int]


BodyT = TypeVar("BodyT", bound=msgspec.Struct)


def decode_body(body: bytes, schema: type[BodyT]) -> BodyT:
    """JSON bytes -> Struct; any failure becomes a 400 (a top-level array included)."""
    try:
        return msgspec.json.decode(body, type=schema)
    except msgspec.DecodeError as exc:
        raise from_decode_error(exc) from None


def message_text(message: ChatMessage) -> str:
    """Text of a message whose content may be a list of parts (only text parts are served)."""
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    return "".join(part.text or "" for part in message.content if part.type == "text")
