"""PD end to end, started as a user starts it: `mtpserve serve --role prefill`, `--role decode`, a mixed
instance for reference, and `mtpserve router`. KV moves between the rank processes over Mooncake (TCP).

The decode instance delays each KV read by `pd.transfer_delay` so a client can leave during a transfer.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import aiohttp
import numpy as np
import pytest

from daemon_harness import Daemon, free_port, metric, model_available, status_of, wait_until
from daemon_harness import post_json as post

pytestmark = pytest.mark.skipif(not model_available(), reason="the bundled model is not there")

TRANSFER_DELAY_S = 0.5
LEASE_S = 6.0


@dataclass
class Router:
    proc: subprocess.Popen
    url: str

    @classmethod
    def start(cls, prefill: list[str], decode: list[str]) -> Router:
        port = free_port()
        argv = [sys.executable, "-m", "mtpserve.cli", "router", "--port", str(port), "--prefill", *prefill,
                "--decode", *decode, "--health-interval", "0.2", "--log-level", "warning"]
        return cls(subprocess.Popen(argv), f"http://127.0.0.1:{port}")

    def wait_healthy(self, timeout_s: float = 120) -> None:
        assert wait_until(lambda: status_of(self.url + "/health") == 200, timeout_s), "router unhealthy"

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    base = tmp_path_factory.mktemp("pd")
    prefill = Daemon.start(base / "p", "--role", "prefill", "--kv-lease-timeout", str(LEASE_S))
    decode = Daemon.start(base / "d", "--role", "decode", "--transfer-delay", str(TRANSFER_DELAY_S))
    mixed = Daemon.start(base / "m")
    daemons = [prefill, decode, mixed]
    router = Router.start([prefill.url], [decode.url])
    try:
        for d in daemons:
            d.wait_healthy()
        router.wait_healthy()
        yield {"prefill": prefill, "decode": decode, "mixed": mixed, "router": router}
    finally:
        router.stop()
        for d in daemons:
            d.stop()


def prompts(n: int) -> list[str]:
    heads = ["def ", "class ", "import ", "    return ", "# ", "for ", "if __name__", "with open(",
             "raise ValueError(", "self."]
    words = ["path", "name", "value", "result", "os", "sys", "data", "index", "key", "line"]
    gen = np.random.default_rng(0)
    return [heads[i % len(heads)] + " ".join(gen.choice(words, int(gen.integers(1, 40))))
            for i in range(n)]


def greedy(prompt: str, **extra) -> dict:
    return {"model": "m", "prompt": prompt, "max_tokens": 32, "temperature": 0, "logprobs": 3, **extra}


def kv_used(daemon: Daemon) -> float:
    return metric(daemon.url, "mtpserve:kv_blocks_used")


def test_routed_greedy_output_equals_mixed_instance(cluster):
    router, mixed = cluster["router"], cluster["mixed"]
    for prompt in prompts(20):
        want = post(mixed.url + "/v1/completions", greedy(prompt))["choices"][0]
        got = post(router.url + "/v1/completions", greedy(prompt))["choices"][0]
        assert got["text"] == want["text"], prompt
        assert got["logprobs"]["tokens"] == want["logprobs"]["tokens"]
        assert got["logprobs"]["token_logprobs"][0] == pytest.approx(
            want["logprobs"]["token_logprobs"][0], abs=1e-4)
        first_top = got["logprobs"]["top_logprobs"][0]
        for token, logprob in want["logprobs"]["top_logprobs"][0].items():
            assert first_top[token] == pytest.approx(logprob, abs=1e-4)
    decode = cluster["decode"].url
    assert wait_until(lambda: metric(decode, "mtpserve:pd_kv_transfers_total") >= 20, 3)
    assert metric(decode, "mtpserve:pd_kv_fallbacks_total") == 0


async def stream_events(url: str, body: dict):
    async with aiohttp.ClientSession() as session:
        async with session.post(url, json={**body, "stream": True}) as response:
            assert response.status == 200
            async for line in response.content:
                line = line.decode().strip()
                if line.startswith("data: "):
                    yield line[6:]


async def test_routed_stream_is_seamless(cluster):
    router, mixed = cluster["router"], cluster["mixed"]
    for prompt in prompts(4):
        want = post(mixed.url + "/v1/completions", greedy(prompt))["choices"][0]
        events = [e async for e in stream_events(router.url + "/v1/completions",
                                                 greedy(prompt, stream_options={"include_usage": True}))]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        usage = [c for c in chunks if c.get("usage")]
        assert len(usage) == 1 and usage[0]["usage"]["completion_tokens"] == 32
        texts = [c["choices"][0]["text"] for c in chunks if c["choices"]]
        assert "".join(texts) == want["text"]
        first = chunks[0]["choices"][0]["logprobs"]
        assert first["token_logprobs"][0] == pytest.approx(want["logprobs"]["token_logprobs"][0], abs=1e-4)
        assert len({c["id"] for c in chunks}) == 1


async def leave_after(url: str, body: dict, num_events: int) -> None:
    count = 0
    async for _ in stream_events(url, body):
        count += 1
        if count >= num_events:
            return  # NOTE: leaving the generator closes the connection


def long_request(prompt: str) -> dict:
    return {"model": "m", "prompt": prompt, "max_tokens": 2000, "temperature": 0, "ignore_eos": True}


@pytest.mark.parametrize("phase,events", [("transfer", 1), ("decode", 6)])
async def test_disconnect_frees_kv_on_both_instances(cluster, phase, events):
    prefill, decode, router = cluster["prefill"], cluster["decode"], cluster["router"]
    before = time.monotonic()
    await leave_after(router.url + "/v1/completions", long_request(prompts(1)[0] * 4), events)
    if phase == "transfer":
        assert time.monotonic() - before < TRANSFER_DELAY_S + 0.5  # left while the read was delayed
    assert await asyncio.to_thread(wait_until, lambda: kv_used(prefill) == 0 and kv_used(decode) == 0,
                                   LEASE_S - 1), (kv_used(prefill), kv_used(decode))


def test_prefill_kv_without_a_decode_is_freed_at_lease_end(cluster):
    prefill = cluster["prefill"]
    answer = post(prefill.url + "/v1/completions", greedy(prompts(2)[1], max_tokens=8))
    assert answer["kv_transfer_params"]["block_ids"]
    time.sleep(0.6)  # NOTE: the gauge comes with the engine's 0.5 s heartbeat
    assert kv_used(prefill) > 0
    assert wait_until(lambda: kv_used(prefill) == 0, LEASE_S + 3)


def test_dead_prefill_gives_503_and_unhealthy_router(cluster):
    router = Router.start([f"http://127.0.0.1:{free_port()}"], [cluster["decode"].url])
    try:
        assert wait_until(lambda: status_of(router.url + "/v1/models") != 0, 30)
        status = status_of(router.url + "/v1/completions", greedy("def f("))
        assert status in (502, 503)
        assert status_of(router.url + "/health") == 503
    finally:
        router.stop()


async def test_killing_the_decode_instance_ends_the_stream_with_an_error(cluster, tmp_path):
    decode = Daemon.start(tmp_path, "--role", "decode")
    router = Router.start([cluster["prefill"].url], [decode.url])
    try:
        decode.wait_healthy()
        router.wait_healthy()
        killed_at, error_at, tokens = None, None, 0
        async for event in stream_events(router.url + "/v1/completions", long_request("import os\n")):
            if event == "[DONE]":
                break
            chunk = json.loads(event)
            if "error" in chunk:
                error_at = time.monotonic()
                break
            tokens += 1
            if tokens == 8:
                killed_at = time.monotonic()
                decode.proc.kill()  # the launcher; its children follow it (PDEATHSIG)
        assert killed_at is not None and error_at is not None
        assert error_at - killed_at < 5.0
    finally:
        router.stop()
        decode.kill_everything()



async def test_echo_through_the_router_matches_the_mixed_instance(cluster):
    router, mixed = cluster["router"], cluster["mixed"]
    body = {"model": "m", "prompt": "import sys\n", "echo": True, "max_tokens": 12, "temperature": 0}
    want = post(mixed.url + "/v1/completions", body)["choices"][0]["text"]
    assert post(router.url + "/v1/completions", body)["choices"][0]["text"] == want
    events = [e async for e in stream_events(router.url + "/v1/completions", body)]
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == want
