"""Prefill/decode disaggregation on the new families, started as a user starts it: a prefill and a decode
instance of a tiny DeepSeek-V3 (MLA: the latent cache moves, one tensor per layer) or ERNIE-4.5 MoE
checkpoint behind `mtpserve router`, against a mixed instance of the same checkpoint: the routed greedy
completions (k = 2, logprobs) equal the mixed instance's."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import deepseek_fixtures
import ernie_fixtures
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from daemon_harness import BUNDLED, Daemon, free_port, metric, status_of, wait_until  # noqa: E402

FAMILIES = {"deepseek": deepseek_fixtures, "ernie": ernie_fixtures}
PROMPTS = [[17, 301, 2045, 88, 999, 4000, 5, 1234, 77], list(range(100, 140)), [3, 3, 3, 9], [4095, 1, 2000] * 7]


def complete(url: str, prompt: list[int]) -> tuple[list[str], list[float]]:
    body = {"model": "m", "prompt": prompt, "max_tokens": 16, "temperature": 0, "logprobs": 1, "ignore_eos": True}
    request = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                     {"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        logprobs = json.loads(response.read())["choices"][0]["logprobs"]
    return logprobs["tokens"], logprobs["token_logprobs"]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_routed_greedy_output_equals_a_mixed_instance(tmp_path, family):
    fixtures = FAMILIES[family]
    model_dir = tmp_path / "model"
    config = fixtures.TINY_V3 if family == "deepseek" else fixtures.TINY_ERNIE
    fixtures.write_checkpoint(model_dir, {**config, "vocab_size": 4096})
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(BUNDLED / name, model_dir / name)
    common = ("--model", str(model_dir), "--num-speculative-tokens", "2", "--speculative-adaptive", "false")
    daemons = [Daemon.start(tmp_path / "p", *common, "--role", "prefill"),
               Daemon.start(tmp_path / "d", *common, "--role", "decode"),
               Daemon.start(tmp_path / "m", *common)]
    port = free_port()
    router = subprocess.Popen([sys.executable, "-m", "mtpserve.cli", "router", "--port", str(port),
                               "--prefill", daemons[0].url, "--decode", daemons[1].url, "--health-interval", "0.2",
                               "--log-level", "warning"])
    url = f"http://127.0.0.1:{port}"
    try:
        for d in daemons:
            d.wait_healthy()
        assert wait_until(lambda: status_of(url + "/health") == 200, 120), "router unhealthy"
        for prompt in PROMPTS:
            routed, mixed = complete(url, prompt), complete(daemons[2].url, prompt)
            assert routed[0] == mixed[0]
            assert np.abs(np.array(routed[1]) - np.array(mixed[1])).max() < 1e-5
        # the decode instance read the prefilled KV (the latent rows for MLA), it did not recompute it
        decode = daemons[1].url
        assert wait_until(lambda: metric(decode, "mtpserve:pd_kv_transfers_total") >= len(PROMPTS), 10)
        assert metric(decode, "mtpserve:pd_kv_fallbacks_total") == 0
    finally:
        router.send_signal(signal.SIGTERM)
        router.wait(15)
        for d in daemons:
            d.stop()
