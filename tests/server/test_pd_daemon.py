"""PD with the real engine: `mtpserve serve --role prefill` and `--role decode` (the bundled model, KV
read over Mooncake TCP), driven over HTTP as the router drives them. Greedy, so the decode instance
serving the same body without params (mixed behaviour) is the reference: the prefill's text plus the
decode's text must be its text, and usage the same. Both run fixed-depth speculation: the adaptive
depth follows measured step times, so equal draft counts would then be luck, while with a fixed depth
they show that the prompt's MTP KV came across with the rest."""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from mtpserve.engine import mtp_window

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from daemon_harness import Daemon, model_available  # noqa: E402
from server_harness import read_events  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not model_available(), reason="needs the bundled model")]
PROMPT = "def fibonacci(n):\n    "


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    fixed = ("--speculative-adaptive", "false")
    prefill = Daemon.start(tmp_path_factory.mktemp("prefill"), "--role", "prefill", *fixed)
    decode = Daemon.start(tmp_path_factory.mktemp("decode"), "--role", "decode", *fixed)
    try:
        prefill.wait_healthy()
        decode.wait_healthy()
        yield prefill.url, decode.url
    finally:
        assert prefill.stop() == 0 and decode.stop() == 0


async def call(url: str, path: str, body: dict, headers: dict | None = None) -> Any:
    """The JSON body, or for a stream the list of its SSE events (each a JSON object)."""
    async with aiohttp.ClientSession() as session:
        async with session.post(url + path, json=body, headers=headers) as resp:
            assert resp.status == 200, await resp.text()
            if body.get("stream"):
                return (await read_events(resp))[0]
            return await resp.json()


def text_of(events: list) -> str:
    return "".join(c["delta"].get("content", "") for e in events if e and e.get("choices") for c in e["choices"])


async def held(url: str) -> float:
    async with aiohttp.ClientSession() as session:
        async with session.get(url + "/metrics") as resp:
            match = re.search(r"^mtpserve:pd_kv_held\{[^}]*\} (\S+)$", await resp.text(), re.M)
            assert match is not None
            return float(match.group(1))


async def test_completion_continues_on_decode_and_release_frees_the_kv(pair):
    prefill, decode = pair
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "logprobs": 1}
    first = await call(prefill, "/v1/completions", body)
    params = first.pop("kv_transfer_params")
    rest = await call(decode, "/v1/completions", {**body, "kv_transfer_params": params})
    whole = await call(decode, "/v1/completions", body)
    [a], [b], [w] = first["choices"], rest["choices"], whole["choices"]
    assert a["text"] + b["text"] == w["text"] and rest["usage"] == whole["usage"]
    assert a["logprobs"]["tokens"] + b["logprobs"]["tokens"] == w["logprobs"]["tokens"]
    deadline = time.monotonic() + 5
    while await held(prefill) < 1:  # the heartbeat carries the count
        assert time.monotonic() < deadline
    async with aiohttp.ClientSession() as session:
        async with session.post(prefill + "/v1/pd/release", json={"transfer_ids": [params["transfer_id"]]}) as resp:
            assert await resp.json() == {"released": 1}
    while await held(prefill) > 0:
        assert time.monotonic() < deadline + 5


async def test_a_long_prompt_hands_over_its_key_start(pair):
    """The prefill's drafts ran over the prompt's last 64 positions (the default window): its params say
    where that MTP KV starts, and the decode instance continues from it to the mixed text."""
    prefill, decode = pair
    body = {"prompt": PROMPT * 40, "max_tokens": 12, "temperature": 0}
    first = await call(prefill, "/v1/completions", body)
    params = first.pop("kv_transfer_params")
    block = params["kv_layout"]["block_size"]
    assert params["mtp_key_start"] == mtp_window.key_start(len(params["prompt_token_ids"]), 64, block) > 0
    rest = await call(decode, "/v1/completions", {**body, "kv_transfer_params": params})
    whole = await call(decode, "/v1/completions", body)
    assert first["choices"][0]["text"] + rest["choices"][0]["text"] == whole["choices"][0]["text"]
    async with aiohttp.ClientSession() as session:
        async with session.post(prefill + "/v1/pd/release", json={"transfer_ids": [params["transfer_id"]]}) as resp:
            assert await resp.json() == {"released": 1}


async def test_chat_stream_continues_without_a_role_chunk(pair):
    prefill, decode = pair
    body = {"messages": [{"role": "user", "content": "Write a loop."}], "max_tokens": 16, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    routed = {"X-Request-Id": "route-1"}  # what a router sends both instances
    first = await call(prefill, "/v1/chat/completions", body, routed)
    params = first[-1]["kv_transfer_params"]
    rest = await call(decode, "/v1/chat/completions", {**body, "kv_transfer_params": params}, routed)
    whole = await call(decode, "/v1/chat/completions", body)
    assert text_of(first) + text_of(rest) == text_of(whole)
    assert not any("role" in c["delta"] for e in rest if e and e.get("choices") for c in e["choices"])
    assert rest[-2]["usage"]["completion_tokens"] == whole[-2]["usage"]["completion_tokens"] == 16
    assert {e["id"] for e in first[:-1] + rest[:-1]} == {"chatcmpl-route-1"}


async def test_stop_string_across_the_handoff(pair):
    prefill, decode = pair
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    plain = (await call(decode, "/v1/completions", body))["choices"][0]["text"]
    one = (await call(prefill, "/v1/completions", {**body, "max_tokens": 1}))["choices"][0]["text"]
    assert one and len(plain) > len(one)
    stop = one[-1] + plain[len(one)]  # starts in the first token's text, ends after it
    body["stop"] = [stop]
    first = await call(prefill, "/v1/completions", body)
    rest = await call(decode, "/v1/completions", {**body, "kv_transfer_params": first.pop("kv_transfer_params")})
    assert first["choices"][0]["text"] + rest["choices"][0]["text"] == plain[:plain.find(stop)]
    assert rest["choices"][0]["finish_reason"] == "stop"
