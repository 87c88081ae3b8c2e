"""Prefix caching through the daemon as a user starts it (the bundled model, fixed-depth speculation):
50 prompts sharing prefixes that end mid-block and on block boundaries give the same tokens, logprobs
(within 1e-5) and speculation counts on a hit as on a miss, at TP = 1 and 2, k = 0..3, and through PD.

A miss is forced with POST /reset_prefix_cache before each request; the hit pass resets once and then
lets each prompt find what the earlier ones left."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from daemon_harness import Daemon, free_port, model_available, post_json, status_of, wait_until

pytestmark = pytest.mark.skipif(not model_available(), reason="bundled model weights not present")

BLOCK = 16  # passed as --block-size: the short text then has several block boundaries
TEXT = '''import os
import sys


def parse_args(argv):
    """Parse the command line into a dictionary of options."""
    options = {}
    for index, arg in enumerate(argv):
        if arg.startswith("--"):
            key, _, value = arg[2:].partition("=")
            options[key] = value or True
    return options


class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        return self.items.pop()

    def peek(self):
        if not self.items:
            raise IndexError("peek from an empty stack")
        return self.items[-1]


def read_config(path):
    with open(path) as handle:
        lines = [line.strip() for line in handle if line.strip() and not line.startswith("#")]
    return dict(line.split("=", 1) for line in lines)


if __name__ == "__main__":
    print(parse_args(sys.argv[1:]), read_config(os.environ.get("CONFIG", "app.cfg")))
'''


def family_prompts(url: str, n: int = 50) -> list[list[int]]:
    """n token-id prompts: prefixes of the code text whose lengths end on a block boundary (2, 3, 4
    blocks) or inside one, each continued by a different slice of the text (0..23 tokens: a 0 repeats
    an earlier prompt exactly)."""
    ids = post_json(url + "/tokenize", {"prompt": TEXT})["tokens"]
    assert len(ids) > 150
    heads = [2 * BLOCK, 2 * BLOCK + 5, 3 * BLOCK, 3 * BLOCK + 11, 4 * BLOCK, 4 * BLOCK + 1]
    gen = np.random.default_rng(0)
    out = []
    for i in range(n):
        head = heads[i % len(heads)]
        start, length = int(gen.integers(head, len(ids) - 24)), int(gen.integers(0, 24))
        out.append(ids[:head] + ids[start:start + length])
    return out


def complete(url: str, prompt: list[int]) -> dict:
    body = {"model": "m", "prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True,
            "logprobs": 1}
    answer = post_json(url + "/v1/completions", body)
    choice, usage = answer["choices"][0], answer["usage"]
    return {"tokens": choice["logprobs"]["tokens"], "logprobs": choice["logprobs"]["token_logprobs"],
            "spec": usage.get("spec_decode"), "cached": usage["prompt_tokens_details"]["cached_tokens"]}


def reset(url: str) -> None:
    assert "num_blocks" in post_json(url + "/reset_prefix_cache", {})


def misses_then_hits(url: str, cache_url: str, prompts: list[list[int]]) -> tuple[list[dict], list[dict]]:
    """`url` answers, `cache_url` holds the cache (the same, or a PD prefill behind a router)."""
    misses = []
    for prompt in prompts:
        reset(cache_url)
        misses.append(complete(url, prompt))
    reset(cache_url)
    return misses, [complete(url, p) for p in prompts]


def check_equal(misses: list[dict], hits: list[dict]) -> None:
    assert all(m["cached"] == 0 for m in misses)
    assert sum(h["cached"] > 0 for h in hits) >= 40  # every family but its first prompt reuses blocks
    for i, (miss, hit) in enumerate(zip(misses, hits)):
        assert hit["tokens"] == miss["tokens"], i
        np.testing.assert_allclose(hit["logprobs"], miss["logprobs"], atol=1e-5, err_msg=str(i))
        assert hit["spec"] == miss["spec"], (i, "speculation differs")


def hits_in_metrics(url: str) -> tuple[float, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        text = response.read().decode()

    def total(name: str) -> float:
        match = re.search(rf"^{name}_total\{{[^}}]*\}} (\S+)$", text, re.M)
        assert match is not None, name
        return float(match.group(1))

    return total("vllm:prefix_cache_queries"), total("vllm:prefix_cache_hits")


def serve_and_compare(tmp_path: Path, tp: int, k: int) -> None:
    args = ["--num-speculative-tokens", str(k), "--speculative-adaptive", "false", "--block-size", str(BLOCK)]
    if tp > 1:
        args += ["--tensor-parallel-size", str(tp), "--master-port", str(free_port())]
    daemon = Daemon.start(tmp_path / f"tp{tp}k{k}", *args)
    try:
        daemon.wait_healthy()
        # NOTE: the warm-up's requests leave neither counts nor blocks behind
        assert wait_until(lambda: hits_in_metrics(daemon.url) == (0.0, 0.0), 5)
        bare = urllib.request.Request(daemon.url + "/reset_prefix_cache", method="POST")  # no body, as curl -X POST
        with urllib.request.urlopen(bare, timeout=10) as response:
            assert json.loads(response.read()) == {"num_blocks": 0}
        prompts = family_prompts(daemon.url)
        misses, hits = misses_then_hits(daemon.url, daemon.url, prompts)
        check_equal(misses, hits)
        assert wait_until(lambda: hits_in_metrics(daemon.url)[1] >= sum(h["cached"] for h in hits), 5)
    finally:
        assert daemon.stop() == 0


def test_a_hit_answers_like_a_miss_at_k2(tmp_path):
    serve_and_compare(tmp_path, tp=1, k=2)


@pytest.mark.slow
@pytest.mark.parametrize("tp,k", [(1, 0), (1, 1), (1, 3), (2, 2), (2, 3)])
def test_a_hit_answers_like_a_miss(tmp_path, tp, k):
    serve_and_compare(tmp_path, tp, k)


@pytest.mark.slow
def test_a_prefill_instance_hit_answers_like_a_miss_through_the_router(tmp_path):
    fixed = ("--speculative-adaptive", "false", "--block-size", str(BLOCK))
    prefill = Daemon.start(tmp_path / "p", "--role", "prefill", *fixed)
    decode = Daemon.start(tmp_path / "d", "--role", "decode", *fixed)
    port = free_port()
    router = subprocess.Popen([sys.executable, "-m", "mtpserve.cli", "router", "--port", str(port),
                               "--prefill", prefill.url, "--decode", decode.url, "--log-level", "warning"])
    url = f"http://127.0.0.1:{port}"
    try:
        prefill.wait_healthy()
        decode.wait_healthy()
        assert wait_until(lambda: status_of(url + "/health") == 200, 60)
        prompts = family_prompts(prefill.url, 30)
        misses, hits = misses_then_hits(url, prefill.url, prompts)
        for i, (miss, hit) in enumerate(zip(misses, hits)):
            assert hit["tokens"] == miss["tokens"], i
            np.testing.assert_allclose(hit["logprobs"], miss["logprobs"], atol=1e-5, err_msg=str(i))
            assert hit["spec"] == miss["spec"], (i, "the drafts the prefill handed on differ")
        queries, cached = hits_in_metrics(prefill.url)
        assert cached > 0 and queries > cached
    finally:
        router.send_signal(signal.SIGTERM)
        router.wait(15)
        assert prefill.stop() == 0 and decode.stop() == 0
