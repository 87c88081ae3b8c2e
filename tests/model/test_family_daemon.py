"""`mtpserve serve --model DIR` on a tiny checkpoint of each family (DeepSeek-V3, ERNIE-4.5 MoE; released
layouts, the bundled tokenizer), through the official OpenAI client: a streamed greedy completion with
logprobs at k = 2, at TP = 1 and 2 (the slow run adds k = 0, 1, 3 at TP = 2), gives, token for token,
the log-probabilities transformers' own implementation computes for its own greedy continuation (so
tokens and logprobs both match)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import deepseek_fixtures
import ernie_fixtures

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from daemon_harness import BUNDLED, Daemon, free_port  # noqa: E402

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
torch.set_num_threads(1)  # NOTE: the reference is tiny; more threads only contend with Paddle's
openai = pytest.importorskip("openai")

PROMPT = [17, 301, 2045, 88, 999, 4000, 5, 1234, 77]
MAX_TOKENS = 24


FAMILIES = {
    "DeepseekV3ForCausalLM": (deepseek_fixtures.write_checkpoint, deepseek_fixtures.TINY_V3),
    "Ernie4_5_MoeForCausalLM": (ernie_fixtures.write_checkpoint, ernie_fixtures.TINY_ERNIE),
}


@pytest.fixture(params=sorted(FAMILIES))
def model_dir(request, tmp_path_factory) -> Path:
    write, config = FAMILIES[request.param]
    directory = tmp_path_factory.mktemp(request.param)
    write(directory, {**config, "vocab_size": 4096})  # the bundled tokenizer's 4096 ids
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(BUNDLED / name, directory / name)
    return directory


def reference_logprobs(model_dir: Path) -> list[float]:
    architecture = json.loads((model_dir / "config.json").read_text())["architectures"][0]
    hf = getattr(transformers, architecture).from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, do_sample=False,
                          eos_token_id=None, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(PROMPT):]
    return [float(torch.log_softmax(s[0], -1)[t]) for s, t in zip(out.scores, tokens)]


@pytest.mark.parametrize(("tp", "k"), [(1, 2), (2, 2), pytest.param(2, 0, marks=pytest.mark.slow),
                                       pytest.param(2, 1, marks=pytest.mark.slow),
                                       pytest.param(2, 3, marks=pytest.mark.slow)])
def test_serves_the_family_streaming_with_logprobs(model_dir, tmp_path, tp, k):
    daemon = Daemon.start(tmp_path, "--model", str(model_dir), "--num-speculative-tokens", str(k),
                          "--speculative-adaptive", "false", "--tensor-parallel-size", str(tp),
                          "--master-port", str(free_port()))
    try:
        daemon.wait_healthy()
        client = openai.OpenAI(base_url=daemon.url + "/v1", api_key="none")
        stream = client.completions.create(model="m", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                           logprobs=2, stream=True, extra_body={"ignore_eos": True})
        served: list[float] = []
        for chunk in stream:
            for choice in chunk.choices:
                if choice.logprobs is not None and choice.logprobs.token_logprobs:
                    served.extend(float(x) for x in choice.logprobs.token_logprobs if x is not None)
    finally:
        assert daemon.stop() == 0
    ref = reference_logprobs(model_dir)
    assert len(served) == MAX_TOKENS
    assert np.abs(np.array(served) - np.array(ref)).max() < 1e-4
