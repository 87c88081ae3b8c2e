"""Every invalid input gets its 4xx in OpenAI's error shape (naming `param` where there is one), the
engine never sees it, and the next normal request succeeds."""

import json

import aiohttp
import pytest

from server_harness import MODEL_NAME

GOOD = {"model": MODEL_NAME, "prompt": "def f():", "max_tokens": 4}
CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}

# (id, path, body (dict -> JSON, bytes -> raw), headers, status, param, code)
CASES = [
    ("negative_max_tokens", "/v1/completions", {**GOOD, "max_tokens": -1}, None, 400, "max_tokens", "invalid_value"),
    ("zero_max_tokens", "/v1/completions", {**GOOD, "max_tokens": 0}, None, 400, "max_tokens", "invalid_value"),
    ("huge_max_tokens", "/v1/completions", {**GOOD, "max_tokens": 10**9}, None, 400, "max_tokens",
     "context_length_exceeded"),
    ("max_tokens_not_int", "/v1/completions", {**GOOD, "max_tokens": "many"}, None, 400, "max_tokens", "invalid_type"),
    ("negative_temperature", "/v1/completions", {**GOOD, "temperature": -1}, None, 400, "temperature", "invalid_value"),
    ("top_p_above_one", "/v1/completions", {**GOOD, "top_p": 1.5}, None, 400, "top_p", "invalid_value"),
    ("top_k_negative", "/v1/completions", {**GOOD, "top_k": -5}, None, 400, "top_k", "invalid_value"),
    ("min_p_above_one", "/v1/completions", {**GOOD, "min_p": 2}, None, 400, "min_p", "invalid_value"),
    ("n_zero", "/v1/completions", {**GOOD, "n": 0}, None, 400, "n", "invalid_value"),
    ("n_million", "/v1/completions", {**GOOD, "n": 10**6}, None, 400, "n", "invalid_value"),
    ("presence_penalty", "/v1/completions", {**GOOD, "presence_penalty": 3}, None, 400, "presence_penalty",
     "invalid_value"),
    ("repetition_penalty_zero", "/v1/completions", {**GOOD, "repetition_penalty": 0}, None, 400,
     "repetition_penalty", "invalid_value"),
    ("min_tokens_over_max", "/v1/completions", {**GOOD, "min_tokens": 10}, None, 400, "min_tokens", None),
    ("logprobs_21", "/v1/completions", {**GOOD, "logprobs": 21}, None, 400, "logprobs", "invalid_value"),
    ("top_logprobs_21", "/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21}, None, 400,
     "top_logprobs", "invalid_value"),
    ("top_logprobs_without_logprobs", "/v1/chat/completions", {**CHAT, "top_logprobs": 2}, None, 400,
     "top_logprobs", None),
    ("stop_100_strings", "/v1/completions", {**GOOD, "stop": [f"s{i}" for i in range(100)]}, None, 400, "stop", None),
    ("stop_empty_string", "/v1/completions", {**GOOD, "stop": [""]}, None, 400, "stop", None),
    ("stop_token_out_of_vocab", "/v1/completions", {**GOOD, "stop_token_ids": [10**7]}, None, 400,
     "stop_token_ids", None),
    ("stream_options_without_stream", "/v1/completions", {**GOOD, "stream_options": {"include_usage": True}},
     None, 400, "stream_options", None),
    ("unknown_model", "/v1/completions", {**GOOD, "model": "gpt-17"}, None, 404, "model", "model_not_found"),
    ("unknown_model_chat", "/v1/chat/completions", {**CHAT, "model": "gpt-17"}, None, 404, "model",
     "model_not_found"),
    ("empty_prompt", "/v1/completions", {**GOOD, "prompt": ""}, None, 400, "prompt", "empty_prompt"),
    ("empty_prompt_list", "/v1/completions", {**GOOD, "prompt": []}, None, 400, "prompt", "empty_prompt"),
    ("mixed_prompt_list", "/v1/completions", {**GOOD, "prompt": ["a", 3]}, None, 400, "prompt", None),
    ("token_id_out_of_vocab", "/v1/completions", {**GOOD, "prompt": [1, 2, 10**6]}, None, 400, "prompt",
     "invalid_token_id"),
    ("negative_token_id", "/v1/completions", {**GOOD, "prompt": [[1, -2]]}, None, 400, "prompt",
     "invalid_token_id"),
    ("prompt_too_long", "/v1/completions", {**GOOD, "prompt": list(range(1, 600))}, None, 400, "prompt",
     "context_length_exceeded"),
    ("missing_prompt", "/v1/completions", {"model": MODEL_NAME}, None, 400, "prompt", None),
    ("empty_messages", "/v1/chat/completions", {**CHAT, "messages": []}, None, 400, "messages", None),
    ("bad_role", "/v1/chat/completions", {**CHAT, "messages": [{"role": "wizard", "content": "x"}]}, None, 400,
     "messages[0].role", "invalid_type"),
    ("echo_with_logprobs", "/v1/completions", {**GOOD, "echo": True, "logprobs": 1}, None, 400, "echo", None),
    ("malformed_json", "/v1/completions", b'{"prompt": "x",', None, 400, None, "invalid_json"),
    ("top_level_array", "/v1/completions", b'[{"prompt": "x"}]', None, 400, None, "invalid_type"),
    ("nan_temperature", "/v1/completions", b'{"prompt": "x", "temperature": NaN}', None, 400, None, "invalid_json"),
    ("wrong_content_type", "/v1/completions", json.dumps(GOOD).encode(), {"Content-Type": "text/plain"}, 415, None,
     "unsupported_media_type"),
    ("form_content_type", "/v1/chat/completions", b"a=b", {"Content-Type": "application/x-www-form-urlencoded"},
     415, None, "unsupported_media_type"),
    ("oversized_body", "/v1/completions", {**GOOD, "prompt": "x" * (128 * 1024)}, None, 413, None,
     "request_too_large"),
    ("unknown_route", "/v1/nothing", GOOD, None, 404, None, "not_found"),
    ("best_of", "/v1/completions", {**GOOD, "best_of": 3}, None, 400, "best_of", "unsupported_parameter"),
    ("logit_bias", "/v1/completions", {**GOOD, "logit_bias": {"5": 10}}, None, 400, "logit_bias",
     "unsupported_parameter"),
    ("json_schema", "/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema"}}, None, 400,
     "response_format", "unsupported_parameter"),
    ("tools", "/v1/chat/completions", {**CHAT, "tools": [{"type": "function"}]}, None, 400, "tools",
     "unsupported_parameter"),
    ("suffix", "/v1/completions", {**GOOD, "suffix": "end"}, None, 400, "suffix", "unsupported_parameter"),
    ("detokenize_out_of_vocab", "/detokenize", {"tokens": [10**6]}, None, 400, "tokens", "invalid_token_id"),
    ("tokenize_neither", "/tokenize", {"model": MODEL_NAME}, None, 400, "prompt", None),
]


async def _post(session, url, body, headers):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = headers or {"Content-Type": "application/json"}
    async with session.post(url, data=data, headers=headers) as resp:
        return resp.status, await resp.json()


@pytest.fixture
async def session():
    async with aiohttp.ClientSession() as s:
        yield s


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
async def test_invalid_input_then_normal_request(fake_server, session, case):
    base_url, _ = fake_server
    _, path, body, headers, status, param, code = case
    got_status, got = await _post(session, base_url + path, body, headers)
    assert got_status == status, got
    assert set(got) == {"error"} and set(got["error"]) == {"message", "type", "param", "code"}
    assert got["error"]["message"]
    assert got["error"]["param"] == param
    if code is not None:
        assert got["error"]["code"] == code
    ok_status, ok = await _post(session, base_url + "/v1/completions", GOOD, None)
    assert ok_status == 200, ok
    assert ok["usage"]["completion_tokens"] == 4


async def test_method_not_allowed_is_openai_shaped(fake_server, session):
    base_url, _ = fake_server
    async with session.get(base_url + "/v1/completions") as resp:
        assert resp.status == 405
        assert (await resp.json())["error"]["code"] == "method_not_allowed"
