import numpy as np
import paddle
import pytest

from mtpserve.engine import rng as counter_rng
from mtpserve.engine.sampler import (RowParams, check_bounds, choose, gather_logprobs,
                                     target_probs)

V = 50


def params(n, **over):
    base = dict(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, presence=0.0, frequency=0.0,
                repetition=1.0, min_tokens=0, out_index=0, seed=0)
    base.update(over)
    col = lambda key, dtype: paddle.to_tensor(np.broadcast_to(np.asarray(base[key]), (n,)).astype(dtype))  # noqa: E731
    return RowParams(
        temperature=col("temperature", np.float32), top_p=col("top_p", np.float32),
        top_k=col("top_k", np.int64), min_p=col("min_p", np.float32),
        presence=col("presence", np.float32), frequency=col("frequency", np.float32),
        repetition=col("repetition", np.float32), min_tokens=col("min_tokens", np.int64),
        out_index=col("out_index", np.int64),
        keys=paddle.to_tensor(counter_rng.seed_to_key(np.broadcast_to(base["seed"], (n,)))),
        stop_ids=paddle.to_tensor(np.asarray(base.get("stop_ids", np.zeros((n, 0))), dtype=np.int64)))


def sample(logits, p, counts=None, prompt_mask=None):
    n = logits.shape[0]
    counts = paddle.zeros([n, V]) if counts is None else counts
    prompt_mask = paddle.zeros([n, V], dtype="bool") if prompt_mask is None else prompt_mask
    probs, greedy = target_probs(logits, counts, prompt_mask, p)
    u = counter_rng.uniforms(p.keys, p.out_index, counter_rng.Purpose.SAMPLE)
    return probs, choose(probs, greedy, u, p.temperature)


def test_seeded_row_does_not_depend_on_batch_neighbours():
    gen = np.random.default_rng(0)
    logits = gen.normal(size=(6, V)).astype(np.float32)
    alone = sample(paddle.to_tensor(logits[:1]), params(1, seed=1234, out_index=5))[1].numpy()
    seeds = np.array([1234, 1, 2, 3, 4, 5])
    batch = sample(paddle.to_tensor(logits), params(6, seed=seeds, out_index=np.array([5, 0, 1, 2, 3, 4]),
                                                     temperature=np.array([1.0, 0.5, 0, 1, 2, 1])))[1]
    assert batch.numpy()[0] == alone[0]
    shuffled = sample(paddle.to_tensor(logits[::-1].copy()),
                      params(6, seed=seeds[::-1].copy(), out_index=np.array([4, 3, 2, 1, 0, 5])))[1]
    assert shuffled.numpy()[-1] == alone[0]


def test_draws_follow_the_filtered_distribution():
    logits = np.random.default_rng(1).normal(size=(1, V)).astype(np.float32)
    n = 40_000
    p = params(n, seed=np.arange(n), top_k=10, top_p=0.8, temperature=0.7)
    probs, ids = sample(paddle.to_tensor(np.repeat(logits, n, 0)), p)
    ref = np.exp(logits[0] / 0.7)
    ref /= ref.sum()
    order = np.argsort(-ref)
    keep = order[:10]
    mass = np.cumsum(ref[keep]) - ref[keep]
    keep = keep[mass < 0.8]
    expected = np.zeros(V)
    expected[keep] = ref[keep] / ref[keep].sum()
    np.testing.assert_allclose(probs.numpy()[0], expected, rtol=1e-4, atol=1e-6)
    freq = np.bincount(ids.numpy(), minlength=V) / n
    assert 0.5 * np.abs(freq - expected).sum() < 0.02
    assert set(np.unique(ids.numpy())) <= set(keep.tolist())


def test_min_p_drops_unlikely_tokens():
    logits = paddle.to_tensor(np.log(np.array([[0.5, 0.3, 0.15, 0.05] + [1e-9] * (V - 4)], np.float32)))
    probs, _ = sample(logits, params(1, min_p=0.2))
    assert (probs.numpy()[0, 3:] == 0).all() and probs.numpy()[0, 2] > 0


def test_greedy_rows_take_the_penalised_argmax():
    logits = np.zeros((1, V), np.float32)
    logits[0, 7], logits[0, 9] = 3.0, 2.5
    counts = np.zeros((1, V), np.float32)
    counts[0, 7] = 2
    _, plain = sample(paddle.to_tensor(logits), params(1, temperature=0.0))
    _, freq = sample(paddle.to_tensor(logits), params(1, temperature=0.0, frequency=0.5),
                     counts=paddle.to_tensor(counts))
    mask = np.zeros((1, V), bool)
    mask[0, 7] = True
    _, rep = sample(paddle.to_tensor(logits), params(1, temperature=0.0, repetition=1.5),
                    prompt_mask=paddle.to_tensor(mask))
    assert (plain.numpy()[0], freq.numpy()[0], rep.numpy()[0]) == (7, 9, 9)


def test_stop_tokens_are_masked_below_min_tokens():
    logits = np.zeros((2, V), np.float32)
    logits[:, 3] = 10.0
    stop_ids = np.array([[3, -1], [3, -1]])
    _, ids = sample(paddle.to_tensor(logits), params(2, temperature=0.0, min_tokens=2,
                                                      out_index=np.array([1, 2]), stop_ids=stop_ids))
    assert ids.numpy().tolist()[1] == 3 and ids.numpy()[0] != 3


def test_logprobs_rank_and_top():
    logits = paddle.to_tensor(np.array([[1.0, 3.0, 2.0] + [0.0] * (V - 3)], np.float32))
    chosen, rank, top_ids, top_lp = gather_logprobs(logits, paddle.to_tensor([2]), 2)
    assert rank.numpy()[0] == 2 and top_ids.numpy()[0].tolist() == [1, 2]
    assert np.isclose(chosen.numpy()[0], top_lp.numpy()[0, 1])


def test_bounds_check_rejects_out_of_vocabulary_ids():
    check_bounds(np.array([0, V - 1]), V)
    with pytest.raises(ValueError):
        check_bounds(np.array([0, V]), V)
    with pytest.raises(ValueError):
        check_bounds(np.array([-1]), V)
