"""The HTTP process of a prefill instance (docs/pd.md): the first token in the client's format plus
`kv_transfer_params`, none when that token ends the request, and the KV releases it owes."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
from multidict import CIMultiDictProxy
import pytest

from mtpserve.ipc.request_channel import AddRequest
from pd_fake_engine import KV_LAYOUT, KV_SESSION, LEASE_S, fake_key_start
from pd_harness import pd_instance, until
from server_harness import MODEL_NAME, read_events

PROMPT = "def main():\n    return 42\n"


@pytest.fixture
async def prefill(tmp_path, text_model):
    async with pd_instance(tmp_path, text_model, "prefill") as inst:
        yield inst


async def post(url: str, path: str, body: dict,
               headers: dict | None = None) -> tuple[int, Any, CIMultiDictProxy[str]]:
    """(status, the JSON body or for a 200 stream the list of its SSE events, headers)."""
    async with aiohttp.ClientSession() as session:
        async with session.post(url + path, json=body, headers=headers) as resp:
            if body.get("stream") and resp.status == 200:
                events, _ = await read_events(resp)
                return resp.status, events, resp.headers
            return resp.status, await resp.json(), resp.headers


def completion(**extra) -> dict:
    return {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 8, **extra}


def chat(**extra) -> dict:
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi there"}], "max_tokens": 8, **extra}


def the_add(engine) -> AddRequest:
    [add] = engine.adds()
    return add


def check_params(params: dict, engine, prompt_ids: list[int]) -> None:
    add = the_add(engine)
    assert add.hold_kv and add.sampling.max_tokens == 1 and add.prompt_token_ids == prompt_ids
    assert params["transfer_id"] == add.request_id
    assert params["kv_session"] == KV_SESSION
    assert params["kv_layout"] == {"block_size": KV_LAYOUT.block_size, "buffer_addrs": KV_LAYOUT.buffer_addrs,
                                   "block_bytes": KV_LAYOUT.block_bytes}
    assert params["block_ids"] == engine.held[add.request_id]
    assert params["prompt_token_ids"] == prompt_ids
    assert params["first_token_id"] == prompt_ids[0]  # the fake generates the prompt again
    assert params["draft_token_ids"] == prompt_ids[1:3]  # k = 2 drafts: the next ones
    assert params["mtp_key_start"] == fake_key_start(len(prompt_ids))  # the engine's KVHeld says it
    assert 0 < params["lease_expires_in"] <= LEASE_S


async def test_completion_stream_ends_with_params(prefill, text_model):
    ids = text_model.encode_batch([PROMPT], True)[0]
    status, events, _ = await post(prefill.url, "/v1/completions",
                                   completion(stream=True, logprobs=2, stream_options={"include_usage": True}))
    assert status == 200
    assert None not in events  # no [DONE]: the decode instance sends it
    *chunks, last = events
    check_params(last["kv_transfer_params"], prefill.engine, ids)
    assert all(c["usage"] is None for c in chunks)  # no usage chunk
    [choice] = [c for chunk in chunks for c in chunk["choices"]]
    assert choice["text"] == text_model.decode([ids[0]]) and choice["finish_reason"] is None
    assert choice["logprobs"]["tokens"] == [choice["text"]] and len(choice["logprobs"]["top_logprobs"][0]) == 2
    await asyncio.sleep(0.1)
    assert not prefill.engine.released()  # handed off: the router releases it, not the HTTP process


async def test_chat_stream_role_then_content_then_params(prefill, text_model):
    status, events, _ = await post(prefill.url, "/v1/chat/completions", chat(stream=True, logprobs=True))
    assert status == 200 and None not in events
    role, content, last = events
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    params = last["kv_transfer_params"]
    first_text = text_model.decode([params["first_token_id"]])
    assert content["choices"][0]["delta"] == {"content": first_text}
    assert content["choices"][0]["finish_reason"] is None
    [entry] = content["choices"][0]["logprobs"]["content"]
    assert entry["token"] == text_model.decode_each([params["first_token_id"]])[0]
    check_params(params, prefill.engine, the_add(prefill.engine).prompt_token_ids)


@pytest.mark.parametrize("path,body", [("/v1/completions", completion()), ("/v1/chat/completions", chat())])
async def test_json_answer_has_params(prefill, path, body):
    status, answer, _ = await post(prefill.url, path, body)
    assert status == 200
    check_params(answer["kv_transfer_params"], prefill.engine, the_add(prefill.engine).prompt_token_ids)
    assert answer["choices"][0]["finish_reason"] is None
    assert answer["usage"]["completion_tokens"] == 1


async def test_kv_held_after_the_frame(prefill, text_model):
    prefill.engine.held_after_frame = True
    status, answer, _ = await post(prefill.url, "/v1/completions", completion())
    assert status == 200
    check_params(answer["kv_transfer_params"], prefill.engine, text_model.encode_batch([PROMPT], True)[0])


async def test_eos_first_token_is_the_final_answer(prefill):
    status, events, _ = await post(prefill.url, "/v1/completions",
                                   completion(prompt=[0, 17, 18], stream=True, stream_options={"include_usage": True}))
    assert status == 200 and events[-1] is None
    assert not any("kv_transfer_params" in (e or {}) for e in events)
    assert events[-2]["usage"]["completion_tokens"] == 1
    assert [c["finish_reason"] for e in events[:-2] for c in e["choices"]][-1] == "stop"
    assert not prefill.engine.held and not prefill.engine.released()


async def test_stop_string_in_first_token_releases_kv(prefill, text_model):
    ids = text_model.encode_batch([PROMPT], True)[0]
    stop = text_model.decode([ids[0]])
    status, answer, _ = await post(prefill.url, "/v1/completions", completion(stop=[stop]))
    assert status == 200 and "kv_transfer_params" not in answer
    assert answer["choices"][0]["finish_reason"] == "stop" and answer["choices"][0]["text"] == ""
    add = the_add(prefill.engine)
    await until(lambda: add.request_id in prefill.engine.released())
    assert not prefill.engine.held


@pytest.mark.parametrize("stream", [False, True])
async def test_one_token_asked_holds_nothing(prefill, stream):
    status, answer, _ = await post(prefill.url, "/v1/completions", completion(max_tokens=1, stream=stream))
    assert status == 200
    add = the_add(prefill.engine)
    assert not add.hold_kv and add.sampling.max_tokens == 1
    if stream:
        assert answer[-1] is None and answer[-2]["choices"][0]["finish_reason"] == "length"
    else:
        assert "kv_transfer_params" not in answer and answer["choices"][0]["finish_reason"] == "length"


async def test_min_tokens_is_capped_at_one(prefill):
    await post(prefill.url, "/v1/completions", completion(min_tokens=5))
    assert the_add(prefill.engine).sampling.min_tokens == 1


async def test_release_endpoint(prefill):
    status, answer, _ = await post(prefill.url, "/v1/completions", completion())
    transfer_id = answer["kv_transfer_params"]["transfer_id"]
    assert transfer_id in prefill.engine.held
    status, body, _ = await post(prefill.url, "/v1/pd/release", {"transfer_ids": [transfer_id, 999]})
    assert (status, body) == (200, {"released": 2})
    await until(lambda: transfer_id not in prefill.engine.held)
    assert prefill.engine.released() == [transfer_id, 999]


async def test_release_endpoint_rejects_bad_bodies(prefill):
    for body in ({"transfer_ids": "1"}, {"transfer_ids": [-1]}, {}):
        status, answer, _ = await post(prefill.url, "/v1/pd/release", body)
        assert status == 400 and answer["error"]["type"] == "invalid_request_error", body


async def test_release_needs_the_api_key(tmp_path, text_model):
    async with pd_instance(tmp_path, text_model, "prefill", api_key="sekrit") as inst:
        status, _, _ = await post(inst.url, "/v1/pd/release", {"transfer_ids": [1]})
        assert status == 401
        status, body, _ = await post(inst.url, "/v1/pd/release", {"transfer_ids": [1]},
                                     {"Authorization": "Bearer sekrit"})
        assert (status, body) == (200, {"released": 1})


async def test_client_gone_before_the_answer_aborts_and_releases(prefill):
    prefill.engine.held_after_frame = True  # the HTTP side is still waiting for KVHeld when we leave
    async with aiohttp.ClientSession() as session:
        async with session.post(prefill.url + "/v1/completions", json=completion(stream=True)) as resp:
            await resp.content.readline()
    add = the_add(prefill.engine)
    await until(lambda: add.request_id in prefill.engine.released())
    assert add.request_id not in prefill.engine.held


@pytest.mark.parametrize("body,param", [
    (completion(n=2), "n"),
    (chat(n=3), "n"),
    (completion(prompt=["a b", "c d"]), "prompt"),
    (completion(kv_transfer_params={}), "kv_transfer_params"),
])
async def test_refused(prefill, body, param):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    status, answer, _ = await post(prefill.url, path, body)
    assert status == 400 and answer["error"]["param"].startswith(param)
    assert not prefill.engine.adds()


@pytest.mark.parametrize("given,expected", [
    ("req-1.a_B", "cmpl-req-1.a_B"), ("cmpl-xyz", "cmpl-xyz"), ("bad id!", None), ("x" * 65, None)])
async def test_x_request_id(prefill, given, expected):
    status, answer, headers = await post(prefill.url, "/v1/completions", completion(), {"X-Request-Id": given})
    assert status == 200 and headers["X-Request-Id"] == answer["id"]
    if expected is None:
        assert answer["id"].startswith("cmpl-") and given not in answer["id"]
    else:
        assert answer["id"] == expected
