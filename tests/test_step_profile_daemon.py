"""The start-up profile kept for restarts, from outside: a daemon started like an earlier one plans with the
step costs that one measured (docs/speculation.md, "The start-up profile")."""

import json
import time
from pathlib import Path

import msgspec
import pytest
from daemon_harness import Daemon, metric, model_available, post_json
from mtpserve.engine.spec_profile import KeptProfile

pytestmark = pytest.mark.skipif(not model_available(), reason="no model weights")

PROFILE_CACHE_VAR = "MTPSERVE_SPECULATIVE_PROFILE_CACHE"


def started_ratio(where: Path, cache: Path) -> float:
    """`predicted_over_measured` of a daemon started with this profile cache."""
    daemon = Daemon.start(where, env={PROFILE_CACHE_VAR: str(cache)})
    try:
        daemon.wait_healthy()
        return predicted_over_measured(daemon)
    finally:
        daemon.stop()


def predicted_over_measured(daemon: Daemon) -> float:
    """The policy's predicted step time over the measured one, over the steps of a few greedy requests."""
    before = step_seconds(daemon)
    for prompt in ("def fib(n):", "The capital of France", "import numpy as np\n"):
        post_json(daemon.url + "/v1/completions", {"model": "m", "prompt": prompt, "max_tokens": 24,
                                                   "temperature": 0, "ignore_eos": True})
    after = step_seconds(daemon)
    return (after[0] - before[0]) / (after[1] - before[1])


def step_seconds(daemon: Daemon) -> tuple[float, float]:
    """(predicted, measured) step seconds so far, once /metrics has them: the engine's counters reach it with
    its stats heartbeat (every 0.5 s), so two reads a second apart agree once it has (the start-up profile's
    steps included)."""
    last = None
    for _ in range(30):
        now = (metric(daemon.url, "mtpserve:spec_step_predicted_seconds_total"),
               metric(daemon.url, "mtpserve:spec_step_measured_seconds_total"))
        if now == last:
            return now
        last = now
        time.sleep(1.0)
    raise AssertionError("the step counters kept moving with no request running")


def test_a_restart_plans_with_the_profile_the_first_start_kept(tmp_path):
    """The first start profiles and keeps one file; doctored so that every curve prices steps 1,000x dearer, the
    file is what the second start plans with: its predicted step time is hundreds of times what it measures,
    where the first start's was near it."""
    cache = tmp_path / "profiles"
    measured_ratio = started_ratio(tmp_path / "first", cache)
    [path] = cache.glob("*.json")
    kept = json.loads(path.read_bytes())
    for name in ("decode", "mixed", "mixed_alone", "depth"):
        kept["costs"][name] = [[[cell, x, 1000 * y, n] for cell, x, y, n in kept["costs"][name][0]]]
    doctored = msgspec.json.encode(msgspec.json.decode(json.dumps(kept).encode(), type=KeptProfile))
    path.write_bytes(doctored)
    doctored_ratio = started_ratio(tmp_path / "second", cache)
    assert 0.2 < measured_ratio < 5
    assert doctored_ratio > 100
    assert path.read_bytes() == doctored  # NOTE: kept, not profiled and written again
