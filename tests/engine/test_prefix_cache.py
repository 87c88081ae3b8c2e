"""Prefix caching in the engine: a hit gives exactly what a miss gives (tokens, logprobs, MTP drafts and
acceptance) with the real model at k = 0..3, and the block accounting stays exact under load, aborts and
preemption (synthetic device, whose KV chains every token, so a wrong reused block changes the output)."""

import numpy as np
import pytest

from mtpserve.engine.engine_core import CoreConfig, EngineCore
from mtpserve.engine.model_runner import ModelRunnerConfig, PaddleModelRunner
from mtpserve.engine.request import EngineRequest, SamplingParams
from mtpserve.engine.scheduler import SchedulerConfig
from mtpserve.engine.synthetic_runner import SyntheticConfig, SyntheticRunner
from test_model_runner import VOCAB, drafty_model

BLOCK = 8


def shared_prefix_prompts(n: int, seed: int = 0) -> list[tuple[int, ...]]:
    """n prompts in families sharing a prefix whose length ends mid-block or on a block boundary
    (1, 1.5, 2, 2.6 and 4 blocks), with suffixes of 0..11 tokens: a suffix of 0 repeats a prompt."""
    gen = np.random.default_rng(seed)
    heads = [tuple(int(t) for t in gen.integers(1, VOCAB, length)) for length in (8, 12, 16, 21, 32)]
    out = []
    for i in range(n):
        head = heads[i % len(heads)]
        tail = tuple(int(t) for t in gen.integers(1, VOCAB, int(gen.integers(0, 12))))
        out.append(head + tail if head + tail else head)
    return out


def model_core(model, k: int, caching: bool, num_blocks: int = 256, prompt_window: int = 0) -> EngineCore:
    sched = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512, max_prefill_chunk=16,
                            num_speculative_tokens=k, num_blocks=num_blocks, block_size=BLOCK,
                            enable_prefix_caching=caching, prompt_window=prompt_window)
    runner = PaddleModelRunner(model, ModelRunnerConfig(max_num_seqs=8, num_blocks=num_blocks,
                                                        block_size=BLOCK, num_speculative_tokens=k))
    return EngineCore(CoreConfig(sched, adaptive_speculation=False), runner)


def run_one_by_one(core: EngineCore, requests: list[EngineRequest]) -> dict:
    """Each request alone (so a hit's only difference from a miss is the reuse): per request its tokens,
    logprobs, drafted and accepted counts; plus the engine's hits."""
    outs: dict = {}
    for request in requests:
        core.add_request(request)
        tokens, logprobs, counts = [], [], (0, 0)
        while core.has_unfinished_requests():
            out = core.step()
            for i, rid in enumerate(out.request_ids):
                n = int(out.num_tokens[:i].sum())
                tokens += out.tokens_of(i).tolist()
                if out.token_logprobs is not None:
                    logprobs += out.token_logprobs[n:n + int(out.num_tokens[i])].tolist()
                counts = (int(out.num_draft_tokens[i]), int(out.num_accepted_tokens[i]))
        outs[request.request_id] = (tokens, np.asarray(logprobs), counts)
    core.scheduler.blocks.check()
    hits = core.scheduler.prefix_cache_hits
    core.close()
    return {"outputs": outs, "hits": hits}


@pytest.fixture(scope="module")
def drafty():
    return drafty_model()


@pytest.mark.parametrize("k,window", [(0, 0), (1, 0), (2, 0), (3, 0), (1, 8), (3, 12)])
def test_a_hit_gives_what_a_miss_gives(drafty, k, window):
    """Outputs, logprobs and drafts alike; with a prompt window (mtp_window.py) the cached blocks before a
    request's key start have no MTP KV, and a request whose drafts read one computes it again."""
    texts = shared_prefix_prompts(50, seed=k)

    def requests():
        return [EngineRequest(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=10, logprobs=2))
                for i, p in enumerate(texts)]

    miss = run_one_by_one(model_core(drafty, k, caching=False, prompt_window=window), requests())
    hit = run_one_by_one(model_core(drafty, k, caching=True, prompt_window=window), requests())
    assert miss["hits"] == 0 and hit["hits"] > 30 * BLOCK  # most families reuse at least one block
    for rid, (tokens, logprobs, counts) in miss["outputs"].items():
        hit_tokens, hit_logprobs, hit_counts = hit["outputs"][rid]
        assert hit_tokens == tokens, rid
        np.testing.assert_allclose(hit_logprobs, logprobs, atol=1e-5, err_msg=rid)
        assert hit_counts == counts, (rid, "acceptance differs")
    if k >= 2:
        assert sum(c[1] for _, _, c in hit["outputs"].values()) > 0  # the accept path ran


def synthetic_core(k: int, caching: bool, num_blocks: int, max_num_seqs: int = 8) -> EngineCore:
    sched = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=256, max_prefill_chunk=24,
                            num_speculative_tokens=k, num_blocks=num_blocks, block_size=BLOCK,
                            enable_prefix_caching=caching)
    runner = SyntheticRunner(SyntheticConfig(step_time_s=0.0, acceptance_rate=0.6, vocab_size=VOCAB,
                                             num_speculative_tokens=k, max_num_seqs=max_num_seqs,
                                             num_blocks=num_blocks, block_size=BLOCK))
    return EngineCore(CoreConfig(sched, adaptive_speculation=False), runner)


def run_batched(core: EngineCore, requests: list[EngineRequest], batch: int, abort_every: int = 0) -> dict:
    pending, outs, steps = list(requests), {}, 0
    while pending or core.has_unfinished_requests():
        while pending and core.scheduler.num_unfinished < batch:
            core.add_request(pending.pop(0))
        out = core.step()
        steps += 1
        for i, rid in enumerate(out.request_ids):
            outs.setdefault(rid, []).extend(out.tokens_of(i).tolist())
        if abort_every and steps % abort_every == 0 and core.scheduler.running:
            core.abort_request(core.scheduler.running[-1].request_id)
        core.scheduler.blocks.check()
    blocks = core.scheduler.blocks
    assert blocks.num_free_blocks == blocks.num_blocks and blocks.num_used_blocks == 0
    result = {"outputs": outs, "hits": core.scheduler.prefix_cache_hits,
              "preemptions": core.scheduler.num_preemptions, "cached": blocks.num_cached_blocks}
    core.close()
    return result


@pytest.mark.parametrize("k", [0, 1, 2, 3])
def test_hits_under_batching_and_preemption_keep_every_output(k):
    """A small cache (preemptions, evictions of cached blocks, hits on blocks other requests hold):
    the synthetic device's tokens chain the whole context, so any wrong reuse changes them."""
    texts = shared_prefix_prompts(60, seed=10 + k)
    requests = [EngineRequest(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=24))
                for i, p in enumerate(texts)]
    miss = run_batched(synthetic_core(k, caching=False, num_blocks=24), requests, batch=6)
    hit = run_batched(synthetic_core(k, caching=True, num_blocks=24), requests, batch=6)
    assert hit["outputs"] == miss["outputs"]
    assert hit["hits"] > 0 and hit["preemptions"] > 0 and hit["cached"] > 0


def test_aborts_keep_the_accounting_exact():
    texts = shared_prefix_prompts(40, seed=3)
    requests = [EngineRequest(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=20))
                for i, p in enumerate(texts)]
    result = run_batched(synthetic_core(2, caching=True, num_blocks=48), requests, batch=5, abort_every=3)
    assert result["hits"] > 0


def test_a_prompt_one_block_long_is_computed_and_a_repeat_reuses_all_but_its_last_token():
    core = synthetic_core(0, caching=True, num_blocks=32)
    one_block = tuple(range(1, BLOCK + 1))
    two_blocks = tuple(range(1, 2 * BLOCK + 1))
    for rid, prompt in (("a", one_block), ("b", one_block), ("c", two_blocks), ("d", two_blocks)):
        core.add_request(EngineRequest(rid, prompt, SamplingParams(temperature=0.0, max_tokens=2)))
        while core.has_unfinished_requests():
            core.step()
    # NOTE: a: miss; b: its only block holds its last token, computed again; c: reuses a's block;
    # d: reuses c's first block only (its second holds its last token).
    assert core.take_prefix_hits() == [("c", BLOCK), ("d", BLOCK)]
    assert core.scheduler.prefix_cache_queries == 2 * BLOCK + 4 * BLOCK
    core.close()


def test_reset_forgets_every_cached_block():
    core = synthetic_core(1, caching=True, num_blocks=32)
    prompt = tuple(range(1, 3 * BLOCK + 2))
    core.add_request(EngineRequest("a", prompt, SamplingParams(temperature=0.0, max_tokens=2)))
    while core.has_unfinished_requests():
        core.step()
    assert core.scheduler.blocks.num_cached_blocks >= 3
    assert core.reset_prefix_cache() >= 3
    core.add_request(EngineRequest("b", prompt, SamplingParams(temperature=0.0, max_tokens=2)))
    while core.has_unfinished_requests():
        core.step()
    assert core.scheduler.prefix_cache_hits == 0
    core.scheduler.blocks.check()
    core.close()


def kv_of(core: EngineCore, block_ids: list[int], length: int) -> list[np.ndarray]:
    """K and V of positions 0..length-1 in every main layer and every MTP depth's cache."""
    rows = np.asarray([block_ids[p // BLOCK] * BLOCK + p % BLOCK for p in range(length)])
    runner = core.runner
    caches = [runner.kv, *(runner.proposer.kv if runner.proposer else ())]
    return [t.numpy()[rows] for cache in caches for t in (*cache.k, *cache.v)]


def prefill_then_kv(core: EngineCore, rid: str, prompt: tuple[int, ...]) -> list[np.ndarray]:
    """Run `rid` until its prompt's KV is written; its KV, then finish it."""
    core.add_request(EngineRequest(rid, prompt, SamplingParams(temperature=0.0, max_tokens=4)))
    request = core.scheduler.get(rid)
    assert request is not None
    while request.is_prefilling or request.num_kv_tokens < len(prompt):
        core.step()
    kv = kv_of(core, request.block_ids, len(prompt))
    while core.has_unfinished_requests():
        core.step()
    return kv


@pytest.mark.parametrize("k", [1, 2, 3])
def test_a_hit_leaves_the_kv_a_miss_computes_in_main_and_mtp_caches(drafty, k):
    """A's block 1 ends a match for B (A's MTP KV at its last positions read A's next tokens); C's
    copy of A's block 0, continued differently, is found for D inside a match."""
    gen = np.random.default_rng(k)
    t0, t1, u = (tuple(int(x) for x in gen.integers(1, VOCAB, n)) for n in (BLOCK, BLOCK, BLOCK))
    a = t0 + t1 + (5, 6, 7, 8, 9)
    b = t0 + t1 + (9, 8, 7, 6, 5, 4)
    c = t0 + u + (1, 2, 3)
    d = t0 + u + (3, 2, 1, 4)
    core = model_core(drafty, k, caching=True)
    kv = {rid: prefill_then_kv(core, rid, p) for rid, p in (("a", a), ("b", b), ("c", c), ("d", d))}
    hits = dict(core.take_prefix_hits())
    assert hits == {"b": 2 * BLOCK - k, "c": BLOCK - k, "d": 2 * BLOCK - k}
    core.close()
    for rid, prompt in (("b", b), ("d", d)):
        miss = prefill_then_kv(model_core(drafty, k, caching=False), rid, prompt)
        for got, want in zip(kv[rid], miss):
            np.testing.assert_allclose(got, want, atol=1e-5, err_msg=rid)


@pytest.mark.parametrize("k", [1, 3])
def test_a_hit_never_reuses_a_block_without_mtp_kv_that_its_drafts_read(drafty, k):
    """With a prompt window of 8 (mtp_window.py), A (30 tokens, key start 16) caches blocks 0 and 1 without MTP
    KV. B (20 tokens, key start 8) shares them: its drafts read block 1, so its match ends before it, and its
    KV is a miss's (main caches everywhere, MTP caches from its key start on)."""
    gen = np.random.default_rng(20 + k)
    t0, t1, t2 = (tuple(int(x) for x in gen.integers(1, VOCAB, n)) for n in (BLOCK, BLOCK, BLOCK))
    a = t0 + t1 + t2 + (5, 6, 7, 8, 9, 10)
    b = t0 + t1 + (9, 8, 7, 6)
    core = model_core(drafty, k, caching=True, prompt_window=8)
    kv = {rid: prefill_then_kv(core, rid, p) for rid, p in (("a", a), ("b", b))}
    assert dict(core.take_prefix_hits()) == {"b": BLOCK - k}  # not 2 * BLOCK - k: block 1 has no MTP KV
    num_main = 2 * len(core.runner.kv.k)
    core.close()
    miss = prefill_then_kv(model_core(drafty, k, caching=False, prompt_window=8), "b", b)
    for i, (got, want) in enumerate(zip(kv["b"], miss)):
        start = 0 if i < num_main else 8
        np.testing.assert_allclose(got[start:], want[start:], atol=1e-5, err_msg=f"cache {i}")
