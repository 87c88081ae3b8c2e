"""The engine core with the real Paddle model (tiny, random weights): MTP never changes greedy output,
penalties apply to verify rows, seeded sampling ignores batch neighbours, drafts follow the MTP layout."""

import numpy as np
import paddle
import pytest

from mtpserve.engine import mtp_window
from mtpserve.engine.engine_core import CoreConfig, EngineCore
from mtpserve.engine.model_runner import ModelRunnerConfig, PaddleModelRunner
from mtpserve.engine.request import EngineRequest, SamplingParams
from mtpserve.engine.scheduler import SchedulerConfig
from mtpserve.model.attention_context import DenseCausalContext
from mtpserve.model.attention_core import mask_to_bias, masked_attention
from mtpserve.model.config import ModelConfig
from mtpserve.model.mimo_model import MiMoForCausalLM

VOCAB = 97


def tiny_model(seed=0, mtp_layers=1, **widths):
    """`widths` override the sizes (e.g. hidden 64, intermediate 96, 4 heads: whole 32-column panels,
    so each block is one fused op on a CPU host)."""
    paddle.seed(seed)
    sizes = {**dict(hidden_size=48, intermediate_size=80, num_attention_heads=6), **widths}
    model = MiMoForCausalLM(ModelConfig(vocab_size=VOCAB, num_hidden_layers=2, num_key_value_heads=2,
                                        num_nextn_predict_layers=mtp_layers, **sizes))
    gen = np.random.default_rng(seed)
    for name, p in model.state_dict().items():
        scale = gen.standard_normal(p.shape)
        value = 1.0 + 0.2 * scale if name.endswith("norm.weight") else 0.15 * scale
        p.set_value(paddle.to_tensor(value.astype(np.float32)))
    model.eval()
    return model


def drafty_model(seed=0, scale=0.6, **widths):
    """A tiny model whose MTP layer drafts well (~75% / 45% / 30% greedy acceptance at k = 3), so the
    accept path is exercised, not only rejection: an untied head maps token x to a fixed permutation
    pi(x), the decoder layers are damped (the residual stream stays close to the current token, with
    some context), and the MTP input projection passes the next token's embedding through. `widths` as
    tiny_model's."""
    paddle.seed(seed)
    sizes = {**dict(hidden_size=48, intermediate_size=80, num_attention_heads=6), **widths}
    model = MiMoForCausalLM(ModelConfig(vocab_size=VOCAB, num_hidden_layers=2, num_key_value_heads=2,
                                        num_nextn_predict_layers=1, tie_word_embeddings=False, **sizes))
    gen = np.random.default_rng(seed)
    state = model.state_dict()
    for name, p in state.items():
        value = gen.standard_normal(p.shape)
        value = 1.0 + 0.2 * value if name.endswith("norm.weight") else 0.15 * value
        if "layers." in name and not name.endswith("norm.weight"):
            value = value * scale
        p.set_value(paddle.to_tensor(value.astype(np.float32)))
    embed = state["model.embed_tokens.weight"].numpy()
    state["lm_head.weight"].set_value(paddle.to_tensor(embed[np.argsort(gen.permutation(VOCAB))]))
    hidden = model.config.hidden_size
    passthrough = np.zeros((hidden, 2 * hidden), np.float32)
    passthrough[:, hidden:] = np.eye(hidden)
    state["model.mtp_layers.0.input_proj.weight"].set_value(paddle.to_tensor(passthrough))
    model.eval()
    return model


_MODELS = {}


@pytest.fixture(scope="module", params=["random", "drafty"])
def model(request):
    if request.param not in _MODELS:
        _MODELS[request.param] = tiny_model() if request.param == "random" else drafty_model()
    return _MODELS[request.param]


@pytest.fixture(scope="module")
def drafty():
    if "drafty" not in _MODELS:
        _MODELS["drafty"] = drafty_model()
    return _MODELS["drafty"]


def make_core(model, k=0, overlap=True, num_blocks=256, max_num_seqs=16, connector=None, adaptive=True,
              prompt_window=0):
    sched = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=512, max_prefill_chunk=16,
                            num_speculative_tokens=k, num_blocks=num_blocks, block_size=8,
                            prompt_window=prompt_window)
    runner = PaddleModelRunner(model, ModelRunnerConfig(max_num_seqs=max_num_seqs, num_blocks=num_blocks,
                                                        block_size=8, num_speculative_tokens=k))
    return EngineCore(CoreConfig(sched, overlap=overlap, adaptive_speculation=adaptive), runner, connector)


def prompts(n, seed=0):
    gen = np.random.default_rng(seed)
    return [tuple(int(t) for t in gen.integers(1, VOCAB, int(gen.integers(3, 30)))) for _ in range(n)]


def run(core, requests, batch):
    pending, outs = list(requests), {}
    while pending or core.has_unfinished_requests():
        while pending and core.scheduler.num_unfinished < batch:
            core.add_request(pending.pop(0))
        out = core.step()
        for i, rid in enumerate(out.request_ids):
            outs.setdefault(rid, []).extend(out.tokens_of(i).tolist())
    assert core.scheduler.blocks.num_free_blocks == core.scheduler.config.num_blocks
    core.close()
    return outs


def greedy_requests(texts, max_tokens=12, **kw):
    return [EngineRequest(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw))
            for i, p in enumerate(texts)]


def dense_logits(model, tokens):
    """Main-model logits of a whole sequence without the paged cache: [S, V], plus MTP hidden."""
    ids = paddle.to_tensor(np.asarray(tokens, np.int64))
    ctx = DenseCausalContext(1, len(tokens))
    out = model.run(ids, paddle.arange(len(tokens), dtype="int64"), ctx)
    return model.compute_logits(out.hidden_states).numpy(), out, ctx


def top2_gap(model, tokens):
    logits = dense_logits(model, tokens)[0][-1]
    logprobs = logits - np.log(np.exp(logits - logits.max()).sum()) - logits.max()
    top = np.sort(logprobs)[-2:]
    return float(top[1] - top[0])


def assert_diverges_only_at_near_ties(model, texts, got, ref):
    """Batched outputs `got` equal the batch-1 `ref` until a position whose top-2 logprobs are within 1e-3."""
    for rid, tokens in got.items():
        if tokens != ref[rid]:
            first = next(i for i, (a, b) in enumerate(zip(tokens, ref[rid])) if a != b)
            prefix = list(texts[int(rid[1:])]) + ref[rid][:first]
            assert top2_gap(model, prefix) < 1e-3, f"{rid} diverged at {first} without a near-tie"


def decoding_steps(core, rid, tokens):
    """Step `core` until it finishes, `tokens` extended by `rid`'s outputs; after each step where `rid` is past
    its prefill, yield its Request."""
    while core.has_unfinished_requests():
        out = core.step()
        req = core.scheduler.get(rid)
        tokens += out.tokens_of(0).tolist() if out.request_ids else []
        if req is not None and not req.is_prefilling:
            yield req


@pytest.mark.parametrize("k", [1, 2, 3])
def test_mtp_greedy_equals_plain_greedy_at_batch_1(model, k):
    texts = prompts(12)
    ref = run(make_core(model, k=0, overlap=False), greedy_requests(texts), batch=1)
    assert run(make_core(model, k=k), greedy_requests(texts), batch=1) == ref


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 2, 3])
def test_mtp_greedy_equals_plain_greedy_on_50_prompts(model, k):
    texts = prompts(50, seed=1)
    ref = run(make_core(model, k=0, overlap=False), greedy_requests(texts, 24), batch=1)
    assert run(make_core(model, k=k), greedy_requests(texts, 24), batch=1) == ref


@pytest.mark.parametrize("k", [0, 2])
def test_batch_16_diverges_only_at_near_ties(model, k):
    texts = prompts(32, seed=2)
    ref = run(make_core(model, k=0, overlap=False), greedy_requests(texts, 16), batch=1)
    got = run(make_core(model, k=k), greedy_requests(texts, 16), batch=16)
    assert_diverges_only_at_near_ties(model, texts, got, ref)


def test_penalties_apply_to_verify_rows_like_plain_decoding(model):
    texts = prompts(8, seed=3)
    kw = dict(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2)
    ref = run(make_core(model, k=0, overlap=False), greedy_requests(texts, 20, **kw), batch=1)
    plain = run(make_core(model, k=0, overlap=False), greedy_requests(texts, 20), batch=1)
    assert ref != plain  # the penalties matter for these prompts
    assert run(make_core(model, k=3), greedy_requests(texts, 20, **kw), batch=8) == ref


@pytest.mark.parametrize("k", [0, 2])
def test_seeded_sampling_ignores_batch_neighbours(model, k):
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=40, seed=1234, max_tokens=16)
    target = EngineRequest("target", prompts(1, seed=4)[0], params)
    alone = run(make_core(model, k=k), [target], batch=1)["target"]
    gen = np.random.default_rng(5)
    others = [EngineRequest(f"n{i}", p, SamplingParams(temperature=float(gen.uniform(0, 2)), max_tokens=16,
                                                       seed=int(gen.integers(1 << 30)) if i % 2 else None))
              for i, p in enumerate(prompts(9, seed=6))]
    crowd = run(make_core(model, k=k), others[:5] + [target] + others[5:], batch=10)
    assert crowd["target"] == alone
    unseeded = EngineRequest("free", target.prompt_ids, SamplingParams(temperature=1.0, max_tokens=16))
    assert run(make_core(model, k=k), [unseeded], 1)["free"] != alone  # the seed is what fixes it


@pytest.mark.parametrize("k", [1, 2])
def test_first_draft_is_the_dense_mtp_prediction(model, k):
    """Depth 0 of the MTP proposer, over a prompt prefilled in three chunks and then decode windows,
    drafts exactly what a dense recompute of the whole sequence predicts (every step drafts k: a step
    that drafts nothing leaves the MTP cache without those positions, by design)."""
    core = make_core(model, k=k, overlap=False, adaptive=False)
    prompt = tuple(int(t) for t in np.random.default_rng(7).integers(1, VOCAB, 40))
    core.add_request(EngineRequest("a", prompt, SamplingParams(temperature=0.0, max_tokens=10)))
    tokens = list(prompt)
    checked = 0
    for req in decoding_steps(core, "a", tokens):
        _, main, ctx = dense_logits(model, tokens)
        shifted = paddle.to_tensor(np.asarray(tokens[1:] + [0], np.int64))
        mtp = model.run_mtp(0, shifted, main.mtp_hidden, paddle.arange(len(tokens), dtype="int64"), ctx)
        expected = int(np.argmax(model.compute_logits(mtp.hidden_states).numpy()[-2]))
        assert core.runner.state.drafts[req.slot, 0] == expected
        checked += 1
    core.close()
    assert checked >= 3


class KeysFrom:
    """A dense causal context whose keys before `start` are hidden from queries at or after it (the serving
    MTP depths' key start, engine/mtp_window.py)."""

    def __init__(self, length, start):
        q = paddle.arange(length).reshape([length, 1])
        keys = paddle.arange(length).reshape([1, length])
        self.bias = mask_to_bias(((keys <= q) & ((keys >= start) | (q < start))).unsqueeze(0))
        self.length = length

    def attend(self, layer, q, k, v):
        n = self.length
        out = masked_attention(q.reshape([1, n, *q.shape[1:]]), k.reshape([1, n, *k.shape[1:]]),
                               v.reshape([1, n, *v.shape[1:]]), self.bias)
        return out.reshape(q.shape)


@pytest.mark.parametrize("window", [8, 20])
def test_with_a_prompt_window_the_first_draft_attends_from_the_key_start(model, window):
    """The MTP depths run over a 41-token prompt's last positions only (prefilled in three chunks of 16): the
    drafts are what a dense recompute predicts with the MTP keys before the key start hidden, not what it
    predicts over the whole prompt, and greedy output is plain greedy's."""
    prompt = tuple(int(t) for t in np.random.default_rng(11).integers(1, VOCAB, 41))
    request = EngineRequest("a", prompt, SamplingParams(temperature=0.0, max_tokens=10))
    core = make_core(model, k=2, overlap=False, adaptive=False, prompt_window=window)
    core.add_request(request)
    start = mtp_window.key_start(len(prompt), window, 8)
    assert start == (32 if window == 8 else 16)
    tokens, checked, whole_differs = list(prompt), 0, False
    for req in decoding_steps(core, "a", tokens):
        assert req.mtp_key_start == core.runner.state.key_start[req.slot] == start
        _, main, _ = dense_logits(model, tokens)
        shifted = paddle.to_tensor(np.asarray(tokens[1:] + [0], np.int64))
        positions = paddle.arange(len(tokens), dtype="int64")
        windowed = model.run_mtp(0, shifted, main.mtp_hidden, positions, KeysFrom(len(tokens), start))
        assert core.runner.state.drafts[req.slot, 0] == int(np.argmax(model.compute_logits(windowed.hidden_states).numpy()[-2]))
        whole = model.run_mtp(0, shifted, main.mtp_hidden, positions, DenseCausalContext(1, len(tokens)))
        whole_differs |= bool(np.abs(whole.hidden_states.numpy()[-2] - windowed.hidden_states.numpy()[-2]).max() > 1e-4)
        checked += 1
    core.close()
    assert checked >= 3 and whole_differs  # the hidden keys mattered: this is not the whole prompt's draft
    ref = run(make_core(model, k=0, overlap=False), [request], batch=1)
    assert tokens[len(prompt):] == ref["a"]


@pytest.mark.parametrize("k", [1, 3])
def test_a_prompt_window_keeps_greedy_output(model, k):
    """Long prompts in chunks, most before their key starts, beside decode windows that attend from theirs."""
    gen = np.random.default_rng(5)
    texts = [tuple(int(t) for t in gen.integers(1, VOCAB, int(gen.integers(20, 70)))) for _ in range(16)]
    ref = run(make_core(model, k=0, overlap=False), greedy_requests(texts), batch=1)
    assert run(make_core(model, k=k, prompt_window=8, adaptive=False), greedy_requests(texts), batch=1) == ref
    got = run(make_core(model, k=k, prompt_window=8, adaptive=False), greedy_requests(texts), batch=16)
    assert_diverges_only_at_near_ties(model, texts, got, ref)


def test_preemption_with_the_model_keeps_greedy_output(model):
    texts = prompts(12, seed=8)
    ref = run(make_core(model, k=0, overlap=False), greedy_requests(texts, 16), batch=1)
    core = make_core(model, k=2, num_blocks=24)
    assert run(core, greedy_requests(texts, 16), batch=12) == ref
    assert core.scheduler.num_preemptions > 0


def test_logprobs_come_from_the_row_that_decided_each_token(model):
    """With MTP, every emitted token (accepted draft or bonus) carries the raw target logprob of the
    position that produced it: the same as a dense recompute of the whole sequence."""
    prompt = prompts(1, seed=9)[0]
    req = EngineRequest("lp", prompt, SamplingParams(temperature=0.0, max_tokens=12, logprobs=3))
    other = EngineRequest("plain", prompts(1, seed=10)[0], SamplingParams(temperature=0.0, max_tokens=12))
    core = make_core(model, k=2)
    core.add_request(req)
    core.add_request(other)
    tokens, lps, ranks, tops = [], [], [], []
    while core.has_unfinished_requests():
        out = core.step()
        for i, rid in enumerate(out.request_ids):
            start = int(out.num_tokens[:i].sum())
            sl = slice(start, start + int(out.num_tokens[i]))
            if rid == "lp":
                assert out.token_logprobs is not None and out.token_ranks is not None
                assert out.top_ids is not None and out.num_top_logprobs is not None
                tokens += out.token_ids[sl].tolist()
                lps += out.token_logprobs[sl].tolist()
                ranks += out.token_ranks[sl].tolist()
                tops += out.top_ids[sl, :3].tolist()
                assert out.num_top_logprobs[i] == 3
            elif out.token_logprobs is not None and out.num_tokens[i]:
                assert np.isnan(out.token_logprobs[sl]).all()
    core.close()
    logits = dense_logits(model, list(prompt) + tokens)[0][len(prompt) - 1:-1]  # [12, V]
    ref = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    np.testing.assert_allclose(lps, ref[np.arange(12), tokens], atol=1e-4)
    assert ranks == [1] * 12  # greedy: every emitted token is the argmax
    assert [t[0] for t in tops] == tokens


def two_sample_chi2_pvalue(a, b, vocab):
    """Homogeneity test of two samples of token ids; sparse categories are pooled into one."""
    from chi_square import chi2_sf

    ca, cb = np.bincount(a, minlength=vocab), np.bincount(b, minlength=vocab)
    keep = (ca + cb) >= 10
    ca = np.append(ca[keep], ca[~keep].sum())
    cb = np.append(cb[keep], cb[~keep].sum())
    total = ca + cb
    nz = total > 0
    ca, cb, total = ca[nz], cb[nz], total[nz]
    ea, eb = total * ca.sum() / total.sum(), total * cb.sum() / total.sum()
    stat = ((ca - ea) ** 2 / ea).sum() + ((cb - eb) ** 2 / eb).sum()
    return chi2_sf(stat, len(total) - 1)


def test_sampled_outputs_keep_their_distribution_with_mtp(drafty):
    """End to end through the engine at temperature > 0: tokens 2..4 of many seeded samples with
    k = 2 (rejection sampling of MTP drafts, over a third of first drafts accepted) follow the same
    distribution as plain sampling (always accepting, or accepting 1.5x too often, fails this by far)."""
    prompt = prompts(1, seed=11)[0]
    n = 1200

    def sample(k):
        params = [SamplingParams(temperature=0.3, top_k=50, seed=s, max_tokens=4) for s in range(n)]
        core = make_core(drafty, k=k, max_num_seqs=64, num_blocks=1024)
        outs = run(core, [EngineRequest(i, prompt, p) for i, p in enumerate(params)], batch=64)
        return np.array([outs[i] for i in range(n)]), core.acceptance.per_position_rate()

    (plain, _), (spec, rates) = sample(0), sample(2)
    assert rates[0] > 0.3, rates  # drafts are really accepted, not only rejected
    for col in (1, 2, 3):
        assert two_sample_chi2_pvalue(plain[:, col], spec[:, col], VOCAB) > 1e-4
    assert (plain != spec).any()  # different random paths, same distribution


def test_kv_budget_counts_main_layers_and_mtp_depths():
    from mtpserve.engine.model_runner import kv_blocks_for_budget

    model = tiny_model()  # K and V, 2 layers, 16 slots, 2 KV heads of 8 dims, fp32: 4 KiB per block
    assert kv_blocks_for_budget(model, 16, 0, 1) == 1024 // 4 - 1
    assert kv_blocks_for_budget(model, 16, 2, 1) == 1024 // 8 - 1  # two MTP depth caches


def test_factory_builds_a_working_engine_from_config_sections():
    from mtpserve.config import EngineConfig, SpeculativeConfig
    from mtpserve.engine.engine_factory import build_model_engine

    model = drafty_model()
    core = build_model_engine(model, EngineConfig(max_num_seqs=4, kv_cache_mb=1, block_size=16),
                              SpeculativeConfig(2))
    assert core.scheduler.config.num_blocks == 1024 // 8 - 1  # 2 KiB per layer and block, 2 + 2 layers
    out = run(core, greedy_requests(prompts(3), 8), batch=4)
    assert all(len(tokens) == 8 for tokens in out.values())
    plain = build_model_engine(tiny_model(mtp_layers=0), EngineConfig(kv_cache_mb=1), SpeculativeConfig(2))
    assert plain.scheduler.config.num_speculative_tokens == 0
    plain.close()
