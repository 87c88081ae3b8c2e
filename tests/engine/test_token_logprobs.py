"""The `mtp_token_logprobs` op (ops_ext/token_logprobs.cc) against a NumPy reference: random shapes,
odd and tiny vocabularies, top-k 0..20, heavy ties, and the row-independence the sampler relies on."""

import numpy as np
import paddle
import paddle.nn.functional as F
import pytest

from mtpserve.engine import sampler
from mtpserve.ops import cpu_op_available

pytestmark = pytest.mark.skipif(paddle.device.is_compiled_with_cuda(), reason="the CPU op")


def op(logits: np.ndarray, ids: np.ndarray, k: int) -> tuple[np.ndarray, ...]:
    assert cpu_op_available(sampler.TOKEN_LOGPROBS_OP), "the op must be built (make install)"
    out = sampler.gather_logprobs(paddle.to_tensor(logits), paddle.to_tensor(ids), k)
    return tuple(t.numpy() for t in out)


def reference(logits: np.ndarray, ids: np.ndarray, k: int) -> tuple[np.ndarray, ...]:
    """float64 log-softmax; rank counts strictly larger logits; top-k larger first, lower id on ties."""
    x = logits.astype(np.float64)
    lse = np.log(np.exp(x - x.max(1, keepdims=True)).sum(1)) + x.max(1)
    rows = np.arange(x.shape[0])
    chosen = x[rows, ids] - lse
    rank = (logits > logits[rows, ids][:, None]).sum(1) + 1
    order = np.stack([np.lexsort((np.arange(x.shape[1]), -logits[r]))[:k] for r in rows])
    return chosen, rank, order, np.take_along_axis(x, order, 1) - lse[:, None]


@pytest.mark.parametrize("rows,vocab,k,ties", [
    (1, 5, 0, False), (1, 5, 5, True), (3, 97, 20, False), (17, 4096, 5, False), (9, 4099, 20, True),
    (48, 4096, 1, True), (2, 21, 20, True),
])
def test_matches_numpy(rows, vocab, k, ties):
    gen = np.random.default_rng(rows * 7919 + vocab + k)
    logits = (gen.integers(-3, 4, (rows, vocab)) if ties else gen.standard_normal((rows, vocab)) * 4)
    logits = logits.astype(np.float32)
    ids = gen.integers(0, vocab, rows).astype(np.int64)
    got, want = op(logits, ids, k), reference(logits, ids, k)
    np.testing.assert_allclose(got[0], want[0], atol=2e-5)
    np.testing.assert_array_equal(got[1], want[1])
    np.testing.assert_array_equal(got[2], want[2])
    np.testing.assert_allclose(got[3], want[3], atol=2e-5)
    assert got[2].shape == (rows, k) and got[2].dtype == np.int64 and got[0].dtype == np.float32


def test_a_rows_result_does_not_depend_on_its_neighbours():
    gen = np.random.default_rng(3)
    logits = (gen.standard_normal((12, 1000)) * 3).astype(np.float32)
    ids = gen.integers(0, 1000, 12).astype(np.int64)
    together = op(logits, ids, 7)
    for r in (0, 5, 11):
        alone = op(logits[r:r + 1], ids[r:r + 1], 7)
        for a, b in zip(alone, together):
            assert a[0].tobytes() == b[r].tobytes()


def test_agrees_with_paddles_log_softmax_path():
    """The op replaces log_softmax + take + topk; on untied logits both give the same answer."""
    gen = np.random.default_rng(5)
    logits = (gen.standard_normal((6, 512)) * 5).astype(np.float32)
    ids = gen.integers(0, 512, 6).astype(np.int64)
    lp = F.log_softmax(paddle.to_tensor(logits), axis=-1).numpy()
    top_lp, top_ids = paddle.topk(paddle.to_tensor(lp), k=4, axis=-1)
    got = op(logits, ids, 4)
    np.testing.assert_allclose(got[0], lp[np.arange(6), ids], atol=1e-5)
    np.testing.assert_array_equal(got[2], top_ids.numpy())
    np.testing.assert_allclose(got[3], top_lp.numpy(), atol=1e-5)


def test_bad_input_is_refused():
    logits = np.zeros((2, 8), np.float32)
    with pytest.raises(Exception, match="vocabulary"):
        op(logits, np.array([0, 8], np.int64), 2)
    with pytest.raises(Exception, match="num_top"):
        op(logits, np.array([0, 1], np.int64), 21)
