"""`mtpserve router --instance` in front of two real instances (the bundled model), started as a user
starts them: cache-aware routing keeps a prefix on one instance (its cache hits), the answers are the
instances' own, and an instance killed mid-run ends its streams in-band while the other carries on."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from daemon_harness import Daemon, free_port, model_available, post_json, status_of, wait_until

pytestmark = pytest.mark.skipif(not model_available(), reason="bundled model weights not present")

SYSTEM = "You are a careful Python reviewer. Answer with code only, no prose, and keep names short. " * 3


@pytest.fixture
def cluster(tmp_path: Path):
    # NOTE: 16-token blocks: the system prompt then fills several, and most of each prompt is a hit
    daemons = [Daemon.start(tmp_path / f"i{i}", "--block-size", "16") for i in range(2)]
    port = free_port()
    router = subprocess.Popen([sys.executable, "-m", "mtpserve.cli", "router", "--instance",
                               *(d.url for d in daemons), "--port", str(port), "--health-interval", "0.2",
                               "--metrics-interval", "0.5", "--log-level", "warning"])
    url = f"http://127.0.0.1:{port}"
    try:
        for daemon in daemons:
            daemon.wait_healthy()
        assert wait_until(lambda: status_of(url + "/health") == 200, 60)
        yield url, daemons
    finally:
        router.send_signal(signal.SIGTERM)
        router.wait(15)
        for daemon in daemons:
            daemon.stop()


def chat(url: str, question: str, **extra) -> dict:
    return post_json(url + "/v1/chat/completions", {
        "model": "m", "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        "max_tokens": 8, "temperature": 0, **extra})


def test_cache_aware_routing_keeps_a_prefix_on_one_instance_and_hits_its_cache(cluster):
    url, daemons = cluster
    answers = [chat(url, f"def f{i}(x):") for i in range(5)]
    cached = [a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers]
    assert cached[0] == 0 and all(c > 0 for c in cached[1:]), cached
    direct = chat(daemons[0].url, "def f4(x):")  # an instance's own answer is the router's
    assert direct["choices"][0]["message"] == answers[4]["choices"][0]["message"]
    health = json.loads(urllib.request.urlopen(url + "/health", timeout=10).read())
    rates = [b["prefix_cache_hit_rate"] for b in health["instances"]]
    assert wait_until(lambda: _best_rate(url) > 0.5, 5), rates  # the instance's own counters, scraped


def _best_rate(url: str) -> float:
    health = json.loads(urllib.request.urlopen(url + "/health", timeout=10).read())
    return max(b["prefix_cache_hit_rate"] or 0.0 for b in health["instances"])


def test_a_killed_instance_ends_its_streams_in_band_and_new_requests_go_to_the_other(cluster):
    url, daemons = cluster
    results: list[str] = []

    def stream(i: int) -> None:
        body = {"model": "m", "prompt": f"# task {i}\ndef work():\n", "max_tokens": 3000, "temperature": 0,
                "ignore_eos": True, "stream": True}
        request = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                         {"content-type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            results.append(response.read().decode())

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    # NOTE: the victim is an instance with streams under way: the policy may have placed all four on
    # one instance (health lists the instances in the order they were given, as `daemons` holds them).
    assert wait_until(lambda: max(_in_flight(url)) > 0, 30)
    time.sleep(1.0)  # NOTE: its streams are under way (3000 tokens take seconds); one not yet answered is retried
    counts = _in_flight(url)
    victim = daemons[counts.index(max(counts))]
    for pid in [victim.proc.pid, *victim.children]:
        os.kill(pid, signal.SIGKILL)
    for thread in threads:
        thread.join(120)
    assert len(results) == 4 and all(r.endswith("data: [DONE]\n\n") for r in results)
    assert any('"error"' in r for r in results), "the killed instance's streams end with an error event"
    for i in range(4):
        answer = chat(url, f"after {i}")  # no 5xx while one instance is healthy
        assert answer["choices"][0]["message"]["content"] is not None


def _in_flight(url: str) -> list[int]:
    health = json.loads(urllib.request.urlopen(url + "/health", timeout=10).read())
    return [b["in_flight"] for b in health["instances"]]
