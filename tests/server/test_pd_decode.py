"""The HTTP process of a decode instance (docs/pd.md): a request with `kv_transfer_params` continues
after the prefill's first token. The reference is the same instance serving the same body without
params (mixed behaviour): prefill text + decode text must be that text, usage the same."""

from __future__ import annotations

import math
import time

import pytest

from mtpserve.ipc.request_channel import AddRequest
from pd_fake_engine import BLOCK_SIZE, KV_LAYOUT, KV_SESSION
from pd_harness import pd_instance
from server_harness import MODEL_NAME
from test_pd_prefill import PROMPT, chat, completion, post


@pytest.fixture
async def pd(tmp_path, text_model):
    async with pd_instance(tmp_path, text_model, "prefill") as prefill:
        async with pd_instance(tmp_path, text_model, "decode") as decode:
            yield prefill, decode


def texts(events: list, key: str) -> str:
    return "".join(c[key] if key == "text" else c["delta"].get("content", "")
                   for e in events if e and "choices" in e for c in e["choices"])


def remote_add(engine) -> AddRequest:
    [add] = [a for a in engine.adds() if a.remote_prefill is not None]
    return add


async def test_completion_stream_continues_after_the_first_token(pd):
    prefill, decode = pd
    body = completion(stream=True, logprobs=1, stream_options={"include_usage": True})
    _, first, headers = await post(prefill.url, "/v1/completions", body)
    params = first[-1]["kv_transfer_params"]
    sent_at = time.time()
    status, rest, _ = await post(decode.url, "/v1/completions", {**body, "kv_transfer_params": params},
                                 {"X-Request-Id": headers["X-Request-Id"]})
    _, whole, _ = await post(decode.url, "/v1/completions", body)
    assert status == 200 and rest[-1] is None
    assert texts(first, "text") + texts(rest, "text") == texts(whole, "text") != ""
    assert rest[-2]["usage"] == whole[-2]["usage"]  # completion_tokens counts the first token
    assert rest[-2]["usage"]["completion_tokens"] == 8
    tokens = [t for e in rest[:-2] for c in e["choices"] for t in c["logprobs"]["tokens"]]
    assert len(tokens) == 7  # the first token's logprobs are not sent again
    assert {e["id"] for e in first[:-1] + rest[:-1]} == {headers["X-Request-Id"]}
    add = remote_add(decode.engine)
    remote = add.remote_prefill
    assert remote is not None
    assert add.prompt_token_ids == params["prompt_token_ids"] and add.sampling.max_tokens == 8
    assert (remote.kv_session, remote.block_ids, remote.first_token_id, remote.draft_token_ids) == (
        KV_SESSION, params["block_ids"], params["first_token_id"], params["draft_token_ids"])
    assert remote.mtp_key_start == params["mtp_key_start"] is not None  # the prefill's, as it said
    assert remote.kv_layout == KV_LAYOUT
    assert abs(remote.lease_deadline - (sent_at + params["lease_expires_in"])) < 2.0


async def test_chat_stream_has_no_second_role_chunk(pd):
    prefill, decode = pd
    body = chat(stream=True)
    _, first, _ = await post(prefill.url, "/v1/chat/completions", body)
    params = first[-1]["kv_transfer_params"]
    _, rest, _ = await post(decode.url, "/v1/chat/completions", {**body, "kv_transfer_params": params})
    _, whole, _ = await post(decode.url, "/v1/chat/completions", body)
    assert not any("role" in c["delta"] for e in rest if e for c in e["choices"])
    assert texts(first, "delta") + texts(rest, "delta") == texts(whole, "delta")
    assert rest[-2]["choices"][0]["finish_reason"] == whole[-2]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("path,body", [("/v1/completions", completion(echo=True)), ("/v1/chat/completions", chat())])
async def test_json_continuation(pd, path, body):
    prefill, decode = pd
    _, first, _ = await post(prefill.url, path, body)
    _, rest, _ = await post(decode.url, path, {**body, "kv_transfer_params": first.pop("kv_transfer_params")})
    _, whole, _ = await post(decode.url, path, body)
    pick = (lambda b: b["choices"][0]["text"]) if "prompt" in body else (
        lambda b: b["choices"][0]["message"]["content"])
    assert pick(first) + pick(rest) == pick(whole)  # echo: only the prefill's answer has the prompt
    assert rest["usage"] == whole["usage"]


async def test_stop_string_across_the_handoff(pd, text_model):
    prefill, decode = pd
    ids = text_model.encode_batch([PROMPT], True)[0]
    one, two = text_model.decode([ids[0]]), text_model.decode(ids[:2])[len(text_model.decode([ids[0]])):]
    body = completion(stop=[one[-1] + two[0]])  # starts in the first token's text, ends in the second's
    _, first, _ = await post(prefill.url, "/v1/completions", body)
    _, rest, _ = await post(decode.url, "/v1/completions", {**body, "kv_transfer_params": first["kv_transfer_params"]})
    _, whole, _ = await post(decode.url, "/v1/completions", body)
    assert whole["choices"][0]["finish_reason"] == rest["choices"][0]["finish_reason"] == "stop"
    assert first["choices"][0]["text"] + rest["choices"][0]["text"] == whole["choices"][0]["text"] == one[:-1]


def good_params(text_model) -> dict:
    ids = text_model.encode_batch([PROMPT], True)[0]
    return {"transfer_id": 5, "kv_session": KV_SESSION,
            "kv_layout": {"block_size": KV_LAYOUT.block_size, "buffer_addrs": KV_LAYOUT.buffer_addrs,
                          "block_bytes": KV_LAYOUT.block_bytes},
            "block_ids": list(range(math.ceil(len(ids) / BLOCK_SIZE))), "prompt_token_ids": ids,
            "first_token_id": ids[0], "draft_token_ids": ids[1:3], "lease_expires_in": 20.0}


def spoiled(text_model, **changes) -> dict:
    params = good_params(text_model)
    for key, value in changes.items():
        if key.startswith("layout_"):
            params["kv_layout"] = {**params["kv_layout"], key.removeprefix("layout_"): value}
        elif value is None:
            del params[key]
        else:
            params[key] = value
    return params


@pytest.mark.parametrize("changes,param", [
    ({"block_ids": "x"}, "kv_transfer_params.block_ids"),
    ({"first_token_id": None}, "kv_transfer_params.first_token_id"),
    ({"lease_expires_in": "soon"}, "kv_transfer_params.lease_expires_in"),
    ({"layout_block_bytes": [4096, 4096, 2048, 1024]}, "kv_transfer_params.kv_layout"),
    ({"layout_block_bytes": [4096, 4096, 2048]}, "kv_transfer_params.kv_layout"),
    ({"layout_block_size": 32}, "kv_transfer_params.kv_layout"),
    ({"block_ids": [0, 1, 2]}, "kv_transfer_params.block_ids"),
    ({"block_ids": [-1, 0]}, "kv_transfer_params.block_ids"),
    ({"first_token_id": 10**6}, "kv_transfer_params.first_token_id"),
    ({"prompt_token_ids": []}, "kv_transfer_params.prompt_token_ids"),
    ({"kv_session": "nohost"}, "kv_transfer_params.kv_session"),
    ({"mtp_key_start": "x"}, "kv_transfer_params.mtp_key_start"),
    ({"mtp_key_start": 3}, "kv_transfer_params.mtp_key_start"),  # not a block start: the kernels refuse it
    ({"mtp_key_start": -BLOCK_SIZE}, "kv_transfer_params.mtp_key_start"),
    ({"mtp_key_start": 10**6 * BLOCK_SIZE}, "kv_transfer_params.mtp_key_start"),  # past the prompt
])
async def test_malformed_params_are_400(tmp_path, text_model, changes, param):
    async with pd_instance(tmp_path, text_model, "decode") as decode:
        params = spoiled(text_model, **changes)
        status, answer, _ = await post(decode.url, "/v1/completions", completion(kv_transfer_params=params))
        assert status == 400 and answer["error"]["param"] == param, answer
        status, _, _ = await post(decode.url, "/v1/completions", completion(kv_transfer_params=good_params(text_model)))
        assert status == 200  # the unspoiled params are served
        assert len(decode.engine.adds()) == 1


async def test_other_refusals(tmp_path, text_model):
    async with pd_instance(tmp_path, text_model, "decode") as decode:
        params = good_params(text_model)
        first_text = text_model.decode([params["first_token_id"]])
        for body, param in [(completion(n=2), "n"), (chat(n=2), "n"),
                            (completion(max_tokens=1, kv_transfer_params=params), "max_tokens"),
                            (completion(stop=[first_text], kv_transfer_params=params), "kv_transfer_params")]:
            path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
            status, answer, _ = await post(decode.url, path, body)
            assert status == 400 and answer["error"]["param"] == param, (body, answer)
        assert not decode.engine.adds()
    async with pd_instance(tmp_path, text_model, "mixed") as mixed:
        status, answer, _ = await post(mixed.url, "/v1/completions", completion(kv_transfer_params=params))
        assert status == 400 and answer["error"]["param"] == "kv_transfer_params"
        status, answer, _ = await post(mixed.url, "/v1/completions", completion(n=2))
        assert status == 200 and len(answer["choices"]) == 2  # a mixed instance still fans out


async def test_decode_instance_serves_plain_requests(tmp_path, text_model):
    async with pd_instance(tmp_path, text_model, "decode") as decode:
        status, answer, _ = await post(decode.url, "/v1/completions",
                                       {"model": MODEL_NAME, "prompt": ["ab cd", "ef gh"], "max_tokens": 4})
        assert status == 200 and [c["finish_reason"] for c in answer["choices"]] == ["length", "length"]
        assert all(a.remote_prefill is None and not a.hold_kv for a in decode.engine.adds())
