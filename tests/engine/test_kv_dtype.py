"""A float16 KV cache (`engine.kv_cache_dtype`): speculation stays lossless over it, prefix-cache block
copies are exact, its outputs track a float32 cache's, and the budget holds twice the blocks. Both the
fused blocks (a packed shape) and the Paddle-op blocks (tiny widths: KVCache.write / gather / copy through
int32 views of the float16 rows) are exercised."""

import numpy as np
import paddle
import pytest

from mtpserve.config import EngineConfig, SpeculativeConfig
from mtpserve.engine.engine_core import CoreConfig, EngineCore
from mtpserve.engine.engine_factory import build_model_engine, runner_config
from mtpserve.engine.model_runner import ModelRunnerConfig, PaddleModelRunner
from mtpserve.engine.request import EngineRequest, SamplingParams
from mtpserve.engine.scheduler import SchedulerConfig
from test_model_runner import VOCAB, drafty_model, greedy_requests, prompts, run, tiny_model

pytestmark = pytest.mark.skipif(paddle.device.is_compiled_with_cuda(), reason="the CPU cache ops")


def packed_model(seed=0):
    """Widths in whole 32-column panels, so each block is one fused op on a CPU host."""
    return tiny_model(seed, hidden_size=64, intermediate_size=96, num_attention_heads=4)


MODELS = {"paddle-op blocks": drafty_model, "fused blocks": packed_model}


@pytest.fixture(scope="module", params=list(MODELS))
def model(request):
    return MODELS[request.param]()


def make_core(model, k, kv_dtype, prefix_caching=False, num_blocks=256):
    sched = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512, max_prefill_chunk=16, num_speculative_tokens=k,
                            num_blocks=num_blocks, block_size=8, enable_prefix_caching=prefix_caching)
    runner = PaddleModelRunner(model, ModelRunnerConfig(max_num_seqs=8, num_blocks=num_blocks, block_size=8,
                                                        num_speculative_tokens=k, kv_dtype=kv_dtype))
    assert runner.kv.k[0].dtype == getattr(paddle, kv_dtype)
    return EngineCore(CoreConfig(sched, adaptive_speculation=False), runner)


@pytest.mark.parametrize("k", [1, 2])
def test_speculation_is_lossless_over_a_float16_cache(model, k):
    texts = prompts(10, seed=3)
    plain = run(make_core(model, 0, "float16"), greedy_requests(texts, 16), batch=1)
    assert run(make_core(model, k, "float16"), greedy_requests(texts, 16), batch=1) == plain
    assert run(make_core(model, k, "float16"), greedy_requests(texts, 16), batch=4) == plain


def test_a_float16_cache_tracks_a_float32_one(model):
    """Same prompts: the first token's logprob distribution barely moves (K/V rounded to 11 bits)."""
    texts = prompts(8, seed=5)

    def first_logprobs(kv_dtype):
        core = make_core(model, 0, kv_dtype)
        for i, p in enumerate(texts):
            core.add_request(EngineRequest(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=4, logprobs=5)))
        rows = {}
        while core.has_unfinished_requests():
            out = core.step()
            starts = np.concatenate([[0], np.cumsum(out.num_tokens)])
            for i, rid in enumerate(out.request_ids):
                if out.top_logprobs is not None and out.num_tokens[i]:
                    rows.setdefault(rid, out.top_logprobs[starts[i]])  # [5]: the first token's top 5
        core.close()
        return np.array([rows[f"r{i}"] for i in range(len(texts))])

    full, half = first_logprobs("float32"), first_logprobs("float16")
    assert not np.array_equal(full, half)  # NOTE: the float16 cache is really in use
    np.testing.assert_allclose(half, full, atol=2e-2)


def test_prefix_hits_over_a_float16_cache_equal_misses(model):
    """A hit copies float16 blocks (int32 views of their rows): the repeat must decode what the first did."""
    shared = tuple(int(t) for t in np.random.default_rng(9).integers(1, VOCAB, 40))
    texts = [shared + (5, 6), shared + (5, 6), shared + (7,)]
    cold = [run(make_core(model, 2, "float16"), greedy_requests([t], 12), batch=1)["r0"] for t in texts]
    core = make_core(model, 2, "float16", prefix_caching=True)
    warm = run(core, greedy_requests(texts, 12), batch=1)
    assert core.scheduler.prefix_cache_hits > 0
    assert [warm[f"r{i}"] for i in range(3)] == cold


def test_the_budget_holds_twice_the_blocks_in_float16():
    model = drafty_model()
    full = runner_config(model, EngineConfig(kv_cache_mb=1), SpeculativeConfig(2))
    half = runner_config(model, EngineConfig(kv_cache_mb=1, kv_cache_dtype="float16"), SpeculativeConfig(2))
    assert (full.kv_dtype, half.kv_dtype) == ("float32", "float16")
    assert half.num_blocks + 1 == 2 * (full.num_blocks + 1)  # NOTE: +1: the scratch block each cache adds
    core = build_model_engine(model, EngineConfig(kv_cache_mb=1, kv_cache_dtype="float16"), SpeculativeConfig(2))
    assert isinstance(core.runner, PaddleModelRunner) and core.runner.kv.k[0].dtype == paddle.float16
    core.close()
