"""Streamed requests through the router: the client sees the prefill's first token then the decode's
rest, exactly what one mixed instance would send; one release per handed-off request."""

from __future__ import annotations

import asyncio

import pytest

from router_harness import DONE, joined_text, sse_events, until, without_ids

COMPLETION = {"model": "fake", "prompt": "a b c", "max_tokens": 6, "stream": True,
              "stream_options": {"include_usage": True}}
CHAT = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": True,
        "logprobs": True}


async def _mixed_events(mixed, router_client, path: str, body: dict) -> list:
    """What one mixed instance answers for the same body (the seed the router chose included)."""
    async with router_client.session.post(mixed.url + path, json=body) as resp:
        return sse_events(await resp.read())


@pytest.mark.parametrize("path, body", [("/v1/completions", {**COMPLETION, "logprobs": 2}),
                                        ("/v1/chat/completions", CHAT)])
async def test_stream_equals_a_mixed_instance(router, prefill, decode, mixed, path, body):
    resp = await router.post(path, json=body, headers={"Authorization": "Bearer k"})
    assert resp.status == 200 and resp.headers["Content-Type"] == "text/event-stream"
    events = sse_events(await resp.read())
    (p_seen,), (d_seen,) = prefill.seen, decode.seen
    expected = await _mixed_events(mixed, router, path, p_seen.body)
    assert without_ids(events) == without_ids(expected)
    assert events[-1] == DONE and events.count(DONE) == 1
    assert not any("kv_transfer_params" in e for e in events if isinstance(e, dict))
    assert (p_seen.stage, d_seen.stage) == ("prefill", "decode")
    assert p_seen.authorization == d_seen.authorization == "Bearer k"
    assert 0 <= p_seen.body["seed"] < 2**63 and d_seen.body["seed"] == p_seen.body["seed"]
    params = d_seen.body.pop("kv_transfer_params")
    assert d_seen.body == p_seen.body  # the same body, plus the params
    await until(lambda: prefill.releases, what="release")
    await asyncio.sleep(0.05)
    assert prefill.releases == [[params["transfer_id"]]]


async def test_one_response_id_and_the_decodes_usage(router, prefill, decode):
    resp = await router.post("/v1/completions", json=COMPLETION)
    events = sse_events(await resp.read())
    assert {e["id"] for e in events if isinstance(e, dict)} == {"cmpl-prefill"} == {resp.headers["X-Request-Id"]}
    assert prefill.seen[0].headers_id is None and decode.seen[0].headers_id == "cmpl-prefill"
    assert events[-2]["usage"]["completion_tokens"] == COMPLETION["max_tokens"]
    assert joined_text(events) == "".join(f" w{prefill.seen[0].body['seed'] % 1000 + i}" for i in range(6))


async def test_client_request_id_goes_to_the_prefill(router, prefill, decode):
    resp = await router.post("/v1/completions", json=COMPLETION, headers={"X-Request-Id": "cmpl-mine"})
    events = sse_events(await resp.read())
    assert {e["id"] for e in events if isinstance(e, dict)} == {"cmpl-mine"}
    assert prefill.seen[0].headers_id == decode.seen[0].headers_id == "cmpl-mine"


async def test_given_seed_is_kept(router, prefill, decode):
    await (await router.post("/v1/completions", json={**COMPLETION, "seed": 42})).read()
    assert prefill.seen[0].body["seed"] == decode.seen[0].body["seed"] == 42


async def test_request_ending_at_prefill_skips_decode(router, prefill, decode):
    resp = await router.post("/v1/completions", json={**COMPLETION, "max_tokens": 1})
    events = sse_events(await resp.read())
    assert [e["choices"][0]["finish_reason"] for e in events[:-1]] == ["length"] and events[-1] == DONE
    assert decode.seen == [] and prefill.releases == []


async def test_prefill_rejection_passes_through(router, prefill, decode):
    prefill.reject = True
    resp = await router.post("/v1/completions", json=COMPLETION)
    assert resp.status == 400
    assert (await resp.json())["error"]["message"] == "bad request from fake"
    assert decode.seen == []


@pytest.mark.parametrize("router_options", [{"stream_idle_timeout": 0.3}])
@pytest.mark.parametrize("knob, reset, code", [("die_after", True, "backend_disconnected"),
                                               ("die_after", False, "backend_disconnected"),
                                               ("hang_after", False, "backend_timeout")])
async def test_decode_failing_mid_stream_ends_with_an_error_event(router, prefill, decode, knob, reset, code):
    setattr(decode, knob, 1)  # NOTE: the decode's first write goes out, then it dies / goes silent
    decode.die_with_reset = reset
    resp = await asyncio.wait_for(router.post("/v1/completions", json=COMPLETION), 5)
    events = sse_events(await asyncio.wait_for(resp.read(), 5))
    assert events[-1] == DONE
    error = events[-2]["error"]
    assert error["code"] == code and error["type"] == "service_unavailable_error"
    assert joined_text(events[:-2]).count(" w") == 3  # the prefill's token and the decode's first pair
    await until(lambda: prefill.releases, what="release")
    await asyncio.sleep(0.05)
    assert prefill.releases == [[prefill_transfer_id(decode)]]


async def test_decode_unreachable_after_prefill_streamed(router, prefill, decode):
    await decode.server.close()
    events = sse_events(await (await router.post("/v1/completions", json=COMPLETION)).read())
    assert joined_text(events).count(" w") == 1
    assert events[-2]["error"]["code"] == "backend_unreachable" and events[-1] == DONE
    await until(lambda: prefill.releases, what="release")


async def test_client_disconnect_mid_decode_aborts_and_releases(router, prefill, decode):
    decode.hang_after = 1
    resp = await router.post("/v1/completions", json=COMPLETION)
    seen = b""
    while seen.count(b"data: ") < 3:  # the prefill's token, then the decode's first two
        seen += await asyncio.wait_for(resp.content.readany(), 5)
    resp.close()
    await asyncio.wait_for(decode.cancelled.wait(), 5)
    await until(lambda: prefill.releases, what="release")
    await asyncio.sleep(0.05)
    assert prefill.releases == [[prefill_transfer_id(decode)]]


def prefill_transfer_id(decode) -> int:
    return decode.seen[0].body["kv_transfer_params"]["transfer_id"]


async def test_client_disconnect_after_the_params_still_releases(router, prefill, decode):
    prefill.hang_after = 2  # the first token and the params are out; the body never ends
    resp = await router.post("/v1/completions", json=COMPLETION)
    await asyncio.wait_for(resp.content.readany(), 5)
    await asyncio.sleep(0.05)  # NOTE: the router reads the params event right behind the token
    resp.close()
    await asyncio.wait_for(prefill.cancelled.wait(), 5)
    await until(lambda: prefill.releases, what="release")
    assert prefill.releases == [[101]] and decode.seen == []


@pytest.mark.parametrize("router_options", [{"stream_idle_timeout": 0.3}])
async def test_prefill_silent_before_its_first_event_is_an_error_event(router, prefill, decode):
    prefill.hang_after = 0
    events = sse_events(await asyncio.wait_for((await router.post("/v1/completions", json=COMPLETION)).read(), 5))
    assert events[0]["error"]["code"] == "backend_timeout" and events[1:] == [DONE]
    assert decode.seen == [] and prefill.releases == []


async def test_decode_ending_without_done_is_an_error(router, prefill, decode):
    decode.end_after = 1
    events = sse_events(await (await router.post("/v1/completions", json=COMPLETION)).read())
    assert events[-2]["error"]["code"] == "backend_truncated" and events[-1] == DONE
    metrics = (await (await router.get("/metrics")).read()).decode()
    assert f'mtpserve:router_backend_errors_total{{kind="truncated",role="decode",url="{decode.url}"}} 1.0' in metrics
    await until(lambda: prefill.releases, what="release")
