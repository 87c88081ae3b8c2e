"""Non-streamed requests through the router: the merged body equals one mixed instance's answer
(id from the prefill); bad input is refused before any backend sees it."""

from __future__ import annotations

import asyncio

import pytest

from router_harness import until

COMPLETION = {"model": "fake", "prompt": "a b c", "max_tokens": 5, "logprobs": 1}
CHAT = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "logprobs": True}


@pytest.mark.parametrize("path, body", [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)])
async def test_merged_body_equals_a_mixed_instance(router, prefill, decode, mixed, path, body):
    resp = await router.post(path, json=body)
    assert resp.status == 200
    merged = await resp.json()
    async with router.session.post(mixed.url + path, json=prefill.seen[0].body) as ref:
        expected = await ref.json()
    assert merged.pop("id").endswith("-prefill") and expected.pop("id").endswith("-mixed")
    assert merged == expected
    params = decode.seen[0].body["kv_transfer_params"]
    await until(lambda: prefill.releases, what="release")
    await asyncio.sleep(0.05)
    assert prefill.releases == [[params["transfer_id"]]]


async def test_prefill_only_answer_is_returned_as_is(router, prefill, decode):
    prefill.no_kv = True
    body = await (await router.post("/v1/completions", json=COMPLETION)).json()
    assert body["id"] == "cmpl-prefill" and body["choices"][0]["finish_reason"] == "length"
    assert "kv_transfer_params" not in body and decode.seen == [] and prefill.releases == []


@pytest.mark.parametrize("who", ["prefill", "decode"])
async def test_backend_rejection_passes_through(router, prefill, decode, who):
    (prefill if who == "prefill" else decode).reject = True
    resp = await router.post("/v1/completions", json=COMPLETION)
    assert resp.status == 400
    assert await resp.json() == {"error": {"message": "bad request from fake", "type": "invalid_request_error",
                                           "param": "prompt", "code": None}}
    if who == "decode":
        await until(lambda: prefill.releases, what="release after the decode's refusal")


@pytest.mark.parametrize("raw, param", [
    (b'{"prompt": "x", "n": 2}', "n"),
    (b'{"prompt": ["x", "y"]}', "prompt"),
    (b'{"prompt": [[1, 2], [3]]}', "prompt"),
    (b'{"prompt": "x", ', None),
    (b'[1, 2]', None),
    (b'{"prompt": "x", "kv_transfer_params": {"transfer_id": 1}}', "kv_transfer_params"),
])
async def test_refused_before_any_backend(router, prefill, raw, param):
    resp = await router.post("/v1/completions", data=raw, headers={"Content-Type": "application/json"})
    assert resp.status == 400
    error = (await resp.json())["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert prefill.seen == []


async def test_single_token_id_prompt_is_one_prompt(router, prefill):
    assert (await router.post("/v1/completions", json={**COMPLETION, "prompt": [1, 2, 3]})).status == 200
