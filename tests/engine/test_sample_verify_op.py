"""The `mtp_sample_verify` op (ops_ext/sample_verify.cc) against the Paddle path it replaces on CPU hosts
(sampler.py's filters and draws, spec_verify.verify), window by window; and on its own, the target
distribution kept through one-hot drafts, with a deliberately broken coin failing the same test."""

import numpy as np
import paddle
import pytest

from mtpserve.engine import rng
from mtpserve.engine.sampler import processed_logits
from mtpserve.engine.spec_verify import (HostSampling, host_sampling_available, sample_and_verify,
                                         sample_and_verify_paddle)
from chi_square import chi2_sf

pytestmark = pytest.mark.skipif(paddle.device.is_compiled_with_cuda(), reason="the CPU op")
VOCAB = 512


def paddle_path(logits: np.ndarray, drafts: np.ndarray, hs: HostSampling, keys: np.ndarray, out_index: np.ndarray,
                is_prefill: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ModelRunner._decide's Paddle path, as it was before the op: [B, k+1] tokens and [B] accepted."""
    b, k = drafts.shape
    width = k + 1
    p = hs.row_params(keys, out_index)
    lg = processed_logits(paddle.to_tensor(logits), None, None, p)
    first, res = sample_and_verify_paddle(lg, paddle.argmax(lg, axis=-1).reshape([b, width]), p, drafts)
    if res is None:
        return first[:, None], np.zeros(b, np.int64)
    tokens, accepted = res.token_ids.numpy(), res.num_accepted.numpy()
    tokens[is_prefill] = -1
    tokens[is_prefill, 0] = first[is_prefill]
    accepted[is_prefill] = 0
    return tokens, accepted


def op(logits: np.ndarray, drafts: np.ndarray, hs: HostSampling, keys: np.ndarray, out_index: np.ndarray,
       is_prefill: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    assert host_sampling_available(), "the op must be built (make install)"
    keys = np.broadcast_to(keys[:, None], out_index.shape)
    k = drafts.shape[1]
    return sample_and_verify(paddle.to_tensor(logits), drafts, hs, rng.uniforms_host(keys, out_index, rng.Purpose.SAMPLE),
                             rng.uniforms_host(keys, out_index, rng.Purpose.ACCEPT)[:, :k], is_prefill)


def random_step(gen: np.random.Generator) -> tuple:
    """A step of 1-8 requests with windows of 1-4 rows: greedy and sampled requests, top-k, top-p, min-p,
    windows that end early, prompt rows, drafts the target likes and drafts it does not, masked tokens."""
    b, k = int(gen.integers(1, 9)), int(gen.integers(0, 4))
    width = k + 1
    logits = (gen.standard_normal((b * width, VOCAB)) * gen.choice([0.5, 2.0, 6.0])).astype(np.float32)
    logits[gen.random(logits.shape) < 0.01] = -np.inf  # NOTE: as min_tokens masks stop tokens
    hs = HostSampling(temperature=gen.choice([0.0, 0.7, 1.0, 1.5], b).astype(np.float32),
                      top_p=gen.choice([1.0, 0.95, 0.5], b).astype(np.float32),
                      top_k=gen.choice([0, 0, 5, 50], b).astype(np.int64),
                      min_p=gen.choice([0.0, 0.0, 0.05], b).astype(np.float32))
    argmax = logits.reshape(b, width, VOCAB).argmax(-1)
    drafts = np.where(gen.random((b, k)) < 0.6, argmax[:, :k], gen.integers(0, VOCAB, (b, k)))
    drafts = np.where(np.arange(k)[None, :] < gen.integers(0, k + 1, b)[:, None], drafts, -1).astype(np.int64)
    keys = rng.seed_to_key(gen.integers(0, 1 << 40, b))
    out_index = gen.integers(0, 1000, b)[:, None] + np.arange(width)[None, :]
    return logits, drafts, hs, keys, out_index, gen.random(b) < 0.2


def tv_and_pvalue(tokens: np.ndarray, p: np.ndarray) -> tuple[float, float]:
    """Total variation distance of the tokens' frequencies from p, and the chi-square test's p-value."""
    n = tokens.shape[0]
    freq = np.bincount(tokens, minlength=p.shape[0]) / n
    return 0.5 * float(np.abs(freq - p).sum()), chi2_sf(float((n * (freq - p) ** 2 / p).sum()), p.shape[0] - 1)


def test_host_uniforms_are_the_paddle_ones_bit_for_bit():
    keys = rng.seed_to_key(np.arange(3000) * 7919 + 3)
    index = np.random.default_rng(1).integers(0, 1 << 30, 3000)
    for purpose in rng.Purpose:
        expected = rng.uniforms(paddle.to_tensor(keys), paddle.to_tensor(index), purpose).numpy()
        np.testing.assert_array_equal(rng.uniforms_host(keys, index, purpose), expected)


def test_the_op_emits_what_the_paddle_path_emits():
    """Window by window, the same tokens and acceptances; a float rounding apart at a draw's boundary (a
    running sum over thousands of small probabilities) may differ in a rare request, never in many."""
    gen = np.random.default_rng(0)
    requests = differ = accepted = 0
    for _ in range(300):
        step = random_step(gen)
        (expected, expected_acc), (tokens, acc) = paddle_path(*step), op(*step)
        same = (tokens == expected).all(axis=1) & (acc == expected_acc)
        requests, differ, accepted = requests + len(same), differ + int((~same).sum()), accepted + int(acc.sum())
        logits = step[0].reshape(len(same), -1, VOCAB)
        emitted = np.take_along_axis(logits, np.maximum(tokens, 0)[:, :, None], axis=2)[:, :, 0]
        assert not np.isneginf(emitted[tokens >= 0]).any(), "a masked token was emitted"
    assert requests > 1000 and accepted > 100  # NOTE: windows were really verified, not only cut short
    assert differ <= requests // 500, f"{differ} of {requests} requests differ"


def test_a_request_does_not_depend_on_its_neighbours():
    gen = np.random.default_rng(2)
    logits, drafts, hs, keys, out_index, is_prefill = random_step(gen)
    alone = op(logits[: out_index.shape[1]], drafts[:1], HostSampling(*(a[:1] for a in hs)), keys[:1], out_index[:1],
               is_prefill[:1])
    together = op(logits, drafts, hs, keys, out_index, is_prefill)
    np.testing.assert_array_equal(together[0][0], alone[0][0])


@pytest.mark.parametrize("broken", [False, True])
def test_one_hot_drafts_keep_the_target_distribution(broken):
    """Many requests verifying the same window, each with its own seed: what each position emits follows the
    target p there (logits log p at T = 1). A coin that accepts 1.5x too often shifts it beyond noise."""
    gen = np.random.default_rng(5)
    vocab, k, rows = 8, 2, 60_000
    p = gen.dirichlet(np.full(vocab, 3.0), size=k + 1).astype(np.float32)
    logits = np.tile(np.log(p), (rows, 1))  # [rows*(k+1), V]
    drafts = np.tile(p[:k].argmax(-1), (rows, 1)).astype(np.int64)  # the mode: accepted ~p(mode)
    keys = np.broadcast_to(rng.seed_to_key(np.arange(rows) + 10**6)[:, None], (rows, k + 1))
    index = np.broadcast_to(np.arange(k + 1)[None, :], (rows, k + 1))
    u_accept = rng.uniforms_host(keys, index, rng.Purpose.ACCEPT)[:, :k] / (1.5 if broken else 1.0)
    params = HostSampling(np.ones(rows, np.float32), np.ones(rows, np.float32), np.zeros(rows, np.int64),
                          np.zeros(rows, np.float32))
    tokens, _ = sample_and_verify(paddle.to_tensor(logits), drafts, params,
                                  rng.uniforms_host(keys, index, rng.Purpose.SAMPLE), u_accept, np.zeros(rows, bool))
    stats = [tv_and_pvalue(tokens[:, j][tokens[:, j] >= 0][:20_000], p[j]) for j in range(2)]
    assert all(tv < 0.01 and pvalue > 1e-4 for tv, pvalue in stats) != broken, stats
