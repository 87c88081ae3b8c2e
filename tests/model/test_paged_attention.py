"""The `mtp_paged_attention` op (ops_ext/paged_attention.cc) against a NumPy reference: decode rows,
verify windows and prefill chunks in one batch, GQA ratios, odd and block-boundary lengths, unused
table entries, and rows that are bit-identical whatever requests share the call."""

import numpy as np
import paddle
import pytest
from paddle import _C_ops

from mtpserve.model.attention_context import PAGED_OP
from mtpserve.ops import cpu_op_available

pytestmark = pytest.mark.skipif(paddle.device.is_compiled_with_cuda(), reason="the CPU op")
BS = 4  # tokens per block


def make(seed, new_tokens, cached, heads, kv_heads, dim=8, num_blocks=40):
    """Requests with `cached[b]` tokens already in the cache and `new_tokens[b]` this step."""
    gen = np.random.default_rng(seed)
    rows = (num_blocks + 1) * BS
    k_cache = gen.standard_normal((rows, kv_heads, dim)).astype(np.float32)
    v_cache = gen.standard_normal((rows, kv_heads, dim)).astype(np.float32)
    lens = [c + n for c, n in zip(cached, new_tokens)]
    max_blocks = max(-(-n // BS) for n in lens) + 1  # NOTE: one unused (-1) entry per row at least
    free = list(gen.permutation(num_blocks))
    tables = np.full((len(lens), max_blocks), -1, np.int32)
    for b, n in enumerate(lens):
        for i in range(-(-n // BS)):
            tables[b, i] = free.pop()
    positions = np.concatenate([np.arange(c, c + n) for c, n in zip(cached, new_tokens)]).astype(np.int64)
    cu = np.concatenate([[0], np.cumsum(new_tokens)]).astype(np.int32)
    q = gen.standard_normal((int(cu[-1]), heads, dim)).astype(np.float32)
    return q, k_cache, v_cache, tables, cu, np.asarray(lens, np.int32), positions


def run_op(q, k_cache, v_cache, tables, cu, lens, positions, key_starts=None):
    assert cpu_op_available(PAGED_OP), "the op must be built (make install)"
    args = [paddle.to_tensor(a) for a in (q, k_cache, v_cache, tables, cu, lens, positions)]
    starts = None if key_starts is None else paddle.to_tensor(np.asarray(key_starts, np.int32))
    return _C_ops._run_custom_op(PAGED_OP, *args, starts, BS)[0].numpy()  # pyright: ignore[reportAttributeAccessIssue]


def reference(q, k_cache, v_cache, tables, cu, lens, positions, key_starts=None):
    heads, kv_heads, dim = q.shape[1], k_cache.shape[1], q.shape[2]
    out = np.zeros_like(q, dtype=np.float64)
    for b in range(len(lens)):
        keys = np.arange(lens[b])
        slots = tables[b, keys // BS].astype(np.int64) * BS + keys % BS
        k, v = k_cache[slots].astype(np.float64), v_cache[slots].astype(np.float64)  # [K, KVH, D]
        for t in range(cu[b], cu[b + 1]):
            seen = (keys <= positions[t]) & (keys >= (0 if key_starts is None else key_starts[b]))
            if not seen.any():
                continue
            for h in range(heads):
                kvh = h // (heads // kv_heads)
                s = k[seen, kvh] @ q[t, h].astype(np.float64) / np.sqrt(dim)
                p = np.exp(s - s.max())
                out[t, h] = (p / p.sum()) @ v[seen, kvh]
    return out


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (6, 1)])
@pytest.mark.parametrize("new_tokens,cached", [
    ([1], [0]), ([1, 1, 1], [3, 4, 17]),            # decode rows, one at a block boundary
    ([3, 3], [5, 12]),                               # verify windows (k + 1 = 3)
    ([9, 1, 3, 4], [0, 31, 7, 4]),                   # a prefill chunk beside decode and verify rows
    ([5], [11]),                                     # a later prefill chunk
])
def test_matches_numpy(heads, kv_heads, new_tokens, cached):
    inputs = make(len(new_tokens) * 31 + heads, new_tokens, cached, heads, kv_heads)
    np.testing.assert_allclose(run_op(*inputs), reference(*inputs), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2)])
def test_keys_before_a_key_start_are_not_seen(heads, kv_heads):
    """An MTP depth run over a prompt's last positions only: each request attends from its key start (a block
    start) on, decode rows and a prompt chunk alike; a row of queries all before it sees nothing (zero)."""
    new_tokens, cached = [1, 3, 6, 2], [21, 9, 10, 4]
    inputs = make(5 + heads, new_tokens, cached, heads, kv_heads)
    starts = [8, 4, 12, 0]
    got = run_op(*inputs, key_starts=starts)
    np.testing.assert_allclose(got, reference(*inputs, key_starts=starts), rtol=1e-5, atol=1e-5)
    whole = run_op(*inputs)
    assert np.abs(got[:10] - whole[:10]).max() > 1e-3  # the hidden keys mattered
    assert got[10:].tobytes() == whole[10:].tobytes()  # a start of 0 hides nothing
    before = run_op(*inputs, key_starts=[8, 4, 20, 0])  # the chunk's positions 10-15 are all before 20...
    assert not before[4:10].any()  # ...but 16 = the last whole block's start caps it: none of its keys seen
    with pytest.raises(OSError, match="block start"):  # NOTE: how Paddle raises a failed PD_CHECK
        run_op(*inputs, key_starts=[8, 5, 12, 0])


def test_a_requests_rows_do_not_depend_on_the_others():
    q, kc, vc, tables, cu, lens, pos = make(7, [3, 1, 5], [9, 20, 2], 8, 2)
    together = run_op(q, kc, vc, tables, cu, lens, pos)
    alone = run_op(q[3:4], kc, vc, tables[1:2], np.array([0, 1], np.int32), lens[1:2], pos[3:4])
    assert alone.tobytes() == together[3:4].tobytes()


def test_a_row_that_sees_no_key_is_zero():
    q, kc, vc, tables, cu, lens, pos = make(9, [2], [3], 4, 2)
    pos[1] = -1  # NOTE: an over-allocated slot: no visible key, its output is ignored by the caller
    assert not run_op(q, kc, vc, tables, cu, lens, pos)[1].any()


@pytest.mark.parametrize("dim", [64, 72])
def test_matches_numpy_at_head_sizes_of_real_models(dim):
    """Vector lanes of 16, and a tail past them (72)."""
    inputs = make(dim, [5, 1, 3], [20, 33, 6], 8, 2, dim=dim)
    np.testing.assert_allclose(run_op(*inputs), reference(*inputs), rtol=1e-5, atol=1e-5)


def test_a_large_call_spread_over_threads_matches_and_keeps_rows_independent():
    """Past ~1M multiply-adds the groups run on the worker pool: same results, and a request's rows
    are bit-identical whether it shares the call or not."""
    new, cached = [96, 1, 3, 64], [160, 250, 90, 0]
    inputs = make(11, new, cached, 8, 2, dim=64, num_blocks=200)
    together = run_op(*inputs)
    np.testing.assert_allclose(together, reference(*inputs), rtol=1e-5, atol=1e-5)
    q, kc, vc, tables, cu, lens, pos = inputs
    alone = run_op(q[:96], kc, vc, tables[:1], np.array([0, 96], np.int32), lens[:1], pos[:96])
    assert alone.tobytes() == together[:96].tobytes()
    small = run_op(q[96:97], kc, vc, tables[1:2], np.array([0, 1], np.int32), lens[1:2], pos[96:97])  # one thread
    assert small.tobytes() == together[96:97].tobytes()


def test_sharp_softmax_matches_numpy():
    """Scores far apart (the exp's clamp and its underflow): large queries make the softmax near one-hot."""
    q, kc, vc, tables, cu, lens, pos = make(13, [4, 1], [30, 57], 8, 2, dim=64)
    inputs = (q * 40.0, kc, vc, tables, cu, lens, pos)
    np.testing.assert_allclose(run_op(*inputs), reference(*inputs), rtol=1e-5, atol=1e-5)


def half_cache(inputs):
    """The same call over a float16 cache, and the float32 values that cache holds (for the reference)."""
    q, kc, vc, tables, cu, lens, pos = inputs
    k16, v16 = kc.astype(np.float16), vc.astype(np.float16)
    return (q, k16, v16, tables, cu, lens, pos), (q, k16.astype(np.float32), v16.astype(np.float32), tables, cu,
                                                  lens, pos)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (6, 1)])
@pytest.mark.parametrize("dim", [8, 64, 72])
def test_a_float16_cache_matches_numpy_on_the_values_it_holds(heads, kv_heads, dim):
    """K/V read as float16 (F16C lanes, and one at a time past the last 8): exactly the rounded values."""
    half, rounded = half_cache(make(dim + heads, [9, 1, 3, 4], [0, 31, 7, 4], heads, kv_heads, dim=dim))
    np.testing.assert_allclose(run_op(*half), reference(*rounded), rtol=1e-5, atol=1e-5)


def test_float16_rows_do_not_depend_on_the_others_and_a_large_call_matches():
    new, cached = [96, 1, 3, 64], [160, 250, 90, 0]
    half, rounded = half_cache(make(21, new, cached, 8, 2, dim=64, num_blocks=200))
    together = run_op(*half)
    np.testing.assert_allclose(together, reference(*rounded), rtol=1e-5, atol=1e-5)
    q, kc, vc, tables, cu, lens, pos = half
    alone = run_op(q[96:97], kc, vc, tables[1:2], np.array([0, 1], np.int32), lens[1:2], pos[96:97])
    assert alone.tobytes() == together[96:97].tobytes()


def test_a_cache_of_another_dtype_is_refused():
    q, kc, vc, tables, cu, lens, pos = make(3, [2], [3], 4, 2)
    with pytest.raises(Exception, match="float32 or float16"):
        run_op(q, kc.astype(np.float64), vc.astype(np.float64), tables, cu, lens, pos)
    with pytest.raises(Exception, match="K and V alike"):
        run_op(q, kc, vc.astype(np.float16), tables, cu, lens, pos)
