"""The Paddle model against the NumPy reference, through the paged KV cache, in mixed batches."""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from model_fixtures import PACKED, Window, make_model, pack, weights_of
from mtpserve.model.attention_context import DenseCausalContext, PagedContext
from mtpserve.model.kv_cache import KVCache
from numpy_reference import Reference

BLOCK = 4
MAX_BLOCKS = 8


@pytest.fixture(params=["tiny", "packed"])
def shape(request) -> dict:
    """Both block paths must match NumPy: TINY's Paddle ops and PACKED's fused op."""
    return PACKED if request.param == "packed" else {}


def assert_close(actual, expected, rel: float = 1e-4) -> None:
    """Max error relative to the reference's scale (element-wise rtol is meaningless near zero)."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert actual.shape == expected.shape
    err = np.abs(actual - expected).max() / np.abs(expected).max()
    assert err < rel, f"relative error {err:.2e}"


def caches(model, num_blocks: int = 32) -> tuple[KVCache, KVCache]:
    c = model.config
    main = KVCache.allocate(c.num_hidden_layers, num_blocks, BLOCK, c.num_key_value_heads, c.head_dim)
    mtp = KVCache.allocate(c.num_nextn_predict_layers, num_blocks, BLOCK, c.num_key_value_heads, c.head_dim)
    return main, mtp


def blocks_for(request: int) -> list[int]:
    return list(range(request * MAX_BLOCKS, (request + 1) * MAX_BLOCKS))


def logits_of(model, batch, kv) -> np.ndarray:
    return model.compute_logits(model.forward(batch, kv).hidden_states).numpy()


def test_prefill_main_and_mtp_logits_match_numpy(shape):
    model = make_model(seed=1, **shape)
    ref = Reference(weights_of(model), model.config)
    ids = np.random.default_rng(0).integers(0, 97, 13)
    kv, mtp_kv = caches(model)
    batch = pack([Window(ids[:-2].tolist(), 0, blocks_for(0))], BLOCK, MAX_BLOCKS)
    out = model.forward(batch, kv)
    ref_logits, ref_hidden = ref.main(ids[:-2])
    assert_close(model.compute_logits(out.hidden_states).numpy(), ref_logits)
    # depth 1 reads token t+1, depth 2 reads token t+2, at the same positions 0..S-1
    d1 = model.mtp_forward(0, batch, paddle.to_tensor(ids[1:-1]), out.mtp_hidden, mtp_kv)
    ref_d1, ref_h1 = ref.mtp(0, ids[1:-1], ref_hidden)
    assert_close(model.compute_logits(d1.hidden_states).numpy(), ref_d1)
    d2 = model.mtp_forward(1, batch, paddle.to_tensor(ids[2:]), d1.mtp_hidden, mtp_kv)
    assert_close(model.compute_logits(d2.hidden_states).numpy(), ref.mtp(1, ids[2:], ref_h1)[0])


def test_untied_head_matches_numpy(shape):
    model = make_model(seed=2, **shape, tie_word_embeddings=False, num_nextn_predict_layers=0)
    assert "lm_head.weight" in model.state_dict()
    ids = np.arange(9) * 7 % 97
    kv, _ = caches(model)
    got = logits_of(model, pack([Window(ids.tolist(), 0, blocks_for(0))], BLOCK, MAX_BLOCKS), kv)
    assert_close(got, Reference(weights_of(model), model.config).main(ids)[0])


def test_mixed_batch_of_prefill_chunk_decode_and_verify_matches_numpy(shape):
    """One call carrying a second prefill chunk, a single decode token and a k+1 verify window."""
    model = make_model(seed=3, **shape)
    ref = Reference(weights_of(model), model.config)
    rng = np.random.default_rng(1)
    seqs = [rng.integers(0, 97, n) for n in (14, 9, 11)]
    kv, _ = caches(model)
    # step 1: the cached prefixes (a first chunk for request 0, whole prompts for the others)
    cut = [6, 8, 8]
    model.forward(pack([Window(s[:c].tolist(), 0, blocks_for(b)) for b, (s, c) in
                        enumerate(zip(seqs, cut))], BLOCK, MAX_BLOCKS), kv)
    # step 2: chunk of 8, one decode token, a verify window of 3
    step = [Window(s[c:].tolist(), c, blocks_for(b)) for b, (s, c) in enumerate(zip(seqs, cut))]
    got = logits_of(model, pack(step, BLOCK, MAX_BLOCKS), kv)
    expected = np.concatenate([ref.main(s)[0][c:] for s, c in zip(seqs, cut)])
    assert_close(got, expected)


def test_incremental_decode_equals_full_recompute(shape):
    model = make_model(seed=4, **shape)
    ids = np.random.default_rng(2).integers(0, 97, 20)
    kv, _ = caches(model)
    full_kv, _ = caches(model)
    model.forward(pack([Window(ids[:5].tolist(), 0, blocks_for(0))], BLOCK, MAX_BLOCKS), kv)
    for pos in range(5, 20):
        step = logits_of(model, pack([Window([int(ids[pos])], pos, blocks_for(0))], BLOCK, MAX_BLOCKS), kv)
        full = logits_of(model, pack([Window(ids[:pos + 1].tolist(), 0, blocks_for(1))], BLOCK, MAX_BLOCKS),
                         full_kv)
        assert_close(step[-1], full[-1], rel=1e-5)


def test_invalid_slots_are_not_written_and_do_not_disturb_valid_tokens(shape):
    """Over-allocated verify tokens (slot -1) leave the cache alone; the valid prefix is unaffected."""
    model = make_model(seed=5, **shape)
    ref = Reference(weights_of(model), model.config)
    ids = np.random.default_rng(3).integers(0, 97, 10)
    kv, _ = caches(model)
    model.forward(pack([Window(ids[:6].tolist(), 0, blocks_for(0))], BLOCK, MAX_BLOCKS), kv)
    before = [k.numpy().copy() for k in kv.k]
    window = Window([int(ids[6]), 11, 12, 13], 6, blocks_for(0), invalid_tail=3)
    got = logits_of(model, pack([window], BLOCK, MAX_BLOCKS), kv)
    assert_close(got[:1], ref.main(ids[:7])[0][6:7])
    scratch = set(range(kv.scratch_slot, kv.scratch_slot + BLOCK))
    for layer, old in enumerate(before):
        changed = set(np.flatnonzero(np.abs(kv.k[layer].numpy() - old).reshape(old.shape[0], -1).max(1)).tolist())
        assert 6 in changed and changed <= {6} | scratch  # position 6 lives in slot 6 (blocks 0, 1, ...)


def test_training_context_matches_serving_path(shape):
    """The dense causal context used for training computes the same logits as the paged path."""
    model = make_model(seed=6, **shape)
    ids = np.random.default_rng(4).integers(0, 97, (2, 7))
    dense = model.run(paddle.to_tensor(ids.flatten()), paddle.arange(7, dtype="int64").tile([2]),
                      DenseCausalContext(2, 7))
    kv, _ = caches(model)
    paged = logits_of(model, pack([Window(r.tolist(), 0, blocks_for(b)) for b, r in enumerate(ids)],
                                  BLOCK, MAX_BLOCKS), kv)
    assert_close(model.compute_logits(dense.hidden_states).numpy(), paged, rel=1e-5)


def test_mtp_layer_incremental_through_its_own_cache_matches_numpy(shape):
    """Depth 1 fed one position at a time through the MTP KV cache equals the full NumPy recompute."""
    model = make_model(seed=7, **shape)
    ref = Reference(weights_of(model), model.config)
    ids = np.random.default_rng(5).integers(0, 97, 12)
    ref_logits, ref_hidden = ref.mtp(0, ids[1:], ref.main(ids[:-1])[1])
    kv, mtp_kv = caches(model)
    out = model.forward(pack([Window(ids[:-1].tolist(), 0, blocks_for(0))], BLOCK, MAX_BLOCKS), kv)
    got = []
    for pos in range(11):
        batch = pack([Window([int(ids[pos + 1])], pos, blocks_for(0))], BLOCK, MAX_BLOCKS)
        step = model.mtp_forward(0, batch, batch.input_ids, out.mtp_hidden[pos:pos + 1], mtp_kv)
        got.append(model.compute_logits(step.hidden_states).numpy()[0])
    assert_close(np.stack(got), ref_logits)


def test_mtp_out_rows_match_full_rows_and_write_the_same_kv(shape):
    """Asking an MTP depth for a few rows gives those rows of the full output, and every row's KV."""
    model = make_model(seed=8, **shape)
    ids = np.random.default_rng(6).integers(0, 97, 10)
    kv, mtp_kv = caches(model)
    batch = pack([Window(ids[:6].tolist(), 0, blocks_for(0)), Window(ids[6:9].tolist(), 0, blocks_for(1))],
                 BLOCK, MAX_BLOCKS)
    out = model.forward(batch, kv)
    shifted = paddle.to_tensor(ids[1:10])
    full = model.mtp_forward(0, batch, shifted, out.mtp_hidden, mtp_kv)
    full_kv = mtp_kv.k[0].numpy().copy()
    mtp_kv.k[0].set_value(paddle.zeros_like(mtp_kv.k[0]))
    rows = paddle.to_tensor(np.array([5, 7]))
    ctx_rows = model.run_mtp(0, shifted, out.mtp_hidden, batch.positions,
                             PagedContext(batch, mtp_kv), out_rows=rows)
    assert_close(ctx_rows.hidden_states.numpy(), full.hidden_states.numpy()[[5, 7]], rel=1e-6)
    assert_close(ctx_rows.mtp_hidden.numpy(), full.mtp_hidden.numpy()[[5, 7]], rel=1e-6)
    np.testing.assert_array_equal(mtp_kv.k[0].numpy(), full_kv)


def test_eval_rebuilds_serving_weights_after_training_changes_them(shape):
    """Eval mode serves from fused, transposed copies: train() drops them, eval() rebuilds them."""
    model = make_model(seed=9, **shape)
    ids = np.random.default_rng(7).integers(0, 97, 5)
    batch = pack([Window(ids.tolist(), 0, blocks_for(0))], BLOCK, MAX_BLOCKS)
    model.train()
    for p in model.parameters():
        p.set_value(p * 1.1)
    trained = logits_of(model, batch, caches(model)[0])
    model.eval()
    ref = Reference(weights_of(model), model.config)
    assert_close(logits_of(model, batch, caches(model)[0]), ref.main(ids)[0])
    assert_close(trained, ref.main(ids)[0])


def test_mtp_token_table_in_eval_matches_the_step_by_step_inputs_of_training(shape):
    """Eval mode looks up token_layernorm(E) @ W_token (tabulated); training computes it per step."""
    model = make_model(seed=8, **shape)
    ids = np.random.default_rng(5).integers(0, 97, (2, 6))
    tokens = paddle.to_tensor(ids.flatten())
    positions = paddle.arange(6, dtype="int64").tile([2])
    prev = paddle.to_tensor(np.random.default_rng(6).standard_normal((12, model.config.hidden_size)).astype(np.float32))
    served = model.run_mtp(1, tokens, prev, positions, DenseCausalContext(2, 6))
    assert model.model.mtp_layers[1].tokens.table is not None
    model.train()
    assert model.model.mtp_layers[1].tokens.table is None
    with paddle.no_grad():
        trained = model.run_mtp(1, tokens, prev, positions, DenseCausalContext(2, 6))
    assert_close(served.hidden_states.numpy(), trained.hidden_states.numpy(), rel=1e-5)
    assert_close(served.mtp_hidden.numpy(), trained.mtp_hidden.numpy(), rel=1e-5)
