"""The `mtp_decoder_layer` op (ops_ext/decoder_layer.cc): one whole decoder block against a float64 NumPy
block (norm, q/k/v with and without bias, rotate-half RoPE, GQA attention over the paged cache, o_proj,
SwiGLU MLP), on batches of decode rows, verify windows and prefill chunks; the K/V it writes; out_rows;
rows that are bit-identical whatever shares the call; and that serving actually takes this path."""

import copy

import numpy as np
import paddle
import pytest
from paddle import _C_ops

from mtpserve.model import fused_layer, small_matmul
from mtpserve.model.attention_context import PagedContext
from mtpserve.model.decoder_layer import DecoderLayer
from mtpserve.model.mtp_layer import MTPLayer
from mtpserve.model import mimo_model
from mtpserve.model.mimo_model import compose_draft_depth
from mtpserve.model.rotary import RotaryEmbedding
from model_fixtures import PACKED, Window, make_model, pack
from numpy_reference import rms_norm, rope
from test_paged_attention import make as make_attention
from test_paged_attention import reference as attention_reference

pytestmark = pytest.mark.skipif(paddle.device.is_compiled_with_cuda(), reason="the CPU op")
BS = 4  # tokens per block, as test_paged_attention's reference assumes
EPS = 1e-6


class Block:
    """Random weights of one block in [in, out] layout, plus their packed panels."""

    def __init__(self, seed, hidden, heads, kv_heads, dim, inter, bias=True):
        gen = np.random.default_rng(seed)

        def w(rows: int, cols: int) -> np.ndarray:
            return (gen.standard_normal(size=(rows, cols)) / np.sqrt(rows)).astype(np.float32)

        self.heads, self.kv_heads, self.dim = heads, kv_heads, dim
        self.norm1 = (1 + 0.1 * gen.standard_normal(size=(hidden,))).astype(np.float32)
        self.norm2 = (1 + 0.1 * gen.standard_normal(size=(hidden,))).astype(np.float32)
        self.qkv = w(hidden, (heads + 2 * kv_heads) * dim)
        self.qkv_bias = (0.1 * gen.standard_normal(size=(self.qkv.shape[1],))).astype(np.float32) if bias else None
        self.o, self.gate_up, self.down = w(heads * dim, hidden), w(hidden, 2 * inter), w(inter, hidden)

    def panels(self, weight, dtype="float32"):
        packed = small_matmul.pack(paddle.to_tensor(weight), dtype)
        assert packed is not None, "the op's weights must pack into panels"
        return packed

    def rounded(self, dtype) -> "Block":
        """This block with its four projections rounded to `dtype` (what float16 panels compute with)."""
        out = copy.copy(self)
        for name in ("qkv", "o", "gate_up", "down"):
            setattr(out, name, getattr(self, name).astype(dtype).astype(np.float32))
        return out


def make_step(seed, new_tokens, cached, hidden=64, kv_heads=2, dim=16, num_blocks=40):
    """Cache rows filled with random K/V for the cached tokens (test_paged_attention's layout), and the
    step's x, positions and slots."""
    _, k_cache, v_cache, tables, cu, lens, positions = make_attention(seed, new_tokens, cached, kv_heads, kv_heads,
                                                                      dim, num_blocks)
    row_of = np.repeat(np.arange(len(lens)), new_tokens)
    slots = tables[row_of, positions // BS].astype(np.int64) * BS + positions % BS
    x = np.random.default_rng(seed + 1).standard_normal((int(cu[-1]), hidden)).astype(np.float32)
    return dict(x=x, k_cache=k_cache, v_cache=v_cache, tables=tables, cu=cu, lens=lens, positions=positions,
                slots=slots)


ROTARY = RotaryEmbedding(16, 10000.0, 256)


def run_op(block: Block, step: dict, out_rows=None, slots=None, panels="float32"):
    """-> (output, K cache, V cache) as NumPy; the caches are the op's in-place writes."""
    assert fused_layer.available(), "the op must be built (make install)"
    k_cache, v_cache = paddle.to_tensor(step["k_cache"]), paddle.to_tensor(step["v_cache"])
    bias = None if block.qkv_bias is None else paddle.to_tensor(block.qkv_bias)
    args = [paddle.to_tensor(step["x"]), paddle.to_tensor(block.norm1), block.panels(block.qkv, panels), bias,
            block.panels(block.o, panels), paddle.to_tensor(block.norm2), block.panels(block.gate_up, panels),
            block.panels(block.down, panels), ROTARY.cos_table, ROTARY.signed_sin_table,
            paddle.to_tensor(step["positions"]), paddle.to_tensor(step["slots"] if slots is None else slots),
            k_cache, v_cache, paddle.to_tensor(step["tables"]), paddle.to_tensor(step["cu"]),
            paddle.to_tensor(step["lens"]), None if out_rows is None else paddle.to_tensor(out_rows)]
    out = _C_ops._run_custom_op(  # pyright: ignore[reportAttributeAccessIssue]
        fused_layer.OP, *args, None, None, None, None, None, None, None, None, None, block.heads, EPS, BS, False)[0]
    return out.numpy(), k_cache.numpy(), v_cache.numpy()


def reference(block: Block, step: dict, out_rows=None):
    """The block in float64: -> (output, K cache, V cache)."""
    h, kvh, d = block.heads, block.kv_heads, block.dim
    x = step["x"].astype(np.float64)
    qkv = rms_norm(x, block.norm1, EPS) @ block.qkv + (0 if block.qkv_bias is None else block.qkv_bias)
    t = x.shape[0]
    q = rope(qkv[:, :h * d].reshape(t, h, d), step["positions"], 10000.0)
    k = rope(qkv[:, h * d:(h + kvh) * d].reshape(t, kvh, d), step["positions"], 10000.0)
    v = qkv[:, (h + kvh) * d:].reshape(t, kvh, d)
    k_cache, v_cache = step["k_cache"].copy(), step["v_cache"].copy()
    keep = step["slots"] >= 0
    k_cache[step["slots"][keep]], v_cache[step["slots"][keep]] = k[keep], v[keep]
    attn = attention_reference(q, k_cache, v_cache, step["tables"], step["cu"], step["lens"], step["positions"])
    hidden = x + attn.reshape(t, h * d) @ block.o
    if out_rows is not None:
        hidden = hidden[out_rows]
    gate_up = rms_norm(hidden, block.norm2, EPS) @ block.gate_up
    inter = block.down.shape[0]
    gate, up = gate_up[:, :inter], gate_up[:, inter:]
    return hidden + (gate / (1 + np.exp(-gate)) * up) @ block.down, k_cache, v_cache


BATCHES = [
    ([1], [0]),                    # the first token
    ([1, 1, 1], [3, 4, 17]),       # decode rows, one at a block boundary
    ([3, 3], [5, 12]),             # verify windows (k + 1 = 3)
    ([9, 1, 3, 4], [0, 31, 7, 4]),  # a prefill chunk beside decode and verify rows
    ([13], [11]),                  # a later prefill chunk, odd length
]


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("new_tokens,cached", BATCHES)
def test_matches_numpy(heads, kv_heads, new_tokens, cached):
    block = Block(heads * 10 + kv_heads, 64, heads, kv_heads, 16, 96)
    step = make_step(len(new_tokens) * 7 + heads, new_tokens, cached, kv_heads=kv_heads)
    got, k_cache, v_cache = run_op(block, step)
    want, want_k, want_v = reference(block, step)
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(k_cache, want_k, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(v_cache, want_v, rtol=1e-4, atol=1e-4)


def test_no_qkv_bias_and_unwritten_slots():
    block = Block(3, 64, 4, 2, 16, 64, bias=False)
    step = make_step(5, [3, 2], [6, 9])
    step["slots"][4] = -1  # NOTE: an over-allocated token: its K/V must not be written anywhere
    got, k_cache, v_cache = run_op(block, step)
    want, want_k, want_v = reference(block, step)
    np.testing.assert_allclose(got[:4], want[:4], rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(k_cache, want_k, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(v_cache, want_v, rtol=1e-4, atol=1e-4)


def test_out_rows_keep_only_those_rows_and_write_every_tokens_kv():
    block = Block(4, 64, 4, 2, 16, 96)
    step = make_step(11, [3, 3, 1], [5, 12, 2])
    rows = np.array([1, 5, 6], np.int64)
    got, k_cache, _ = run_op(block, step, out_rows=rows)
    full, full_k, _ = run_op(block, step)
    assert got.shape == (3, 64)
    assert got.tobytes() == full[rows].tobytes()
    assert k_cache.tobytes() == full_k.tobytes()
    want, _, _ = reference(block, step, out_rows=rows)
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)


def test_a_requests_rows_do_not_depend_on_the_others():
    block = Block(6, 64, 4, 2, 16, 96)
    step = make_step(13, [3, 1, 5], [9, 20, 2])
    together, _, _ = run_op(block, step)
    alone = dict(step, x=step["x"][3:4], tables=step["tables"][1:2], cu=np.array([0, 1], np.int32),
                 lens=step["lens"][1:2], positions=step["positions"][3:4], slots=step["slots"][3:4])
    got, _, _ = run_op(block, alone)
    assert got.tobytes() == together[3:4].tobytes()


def test_bad_inputs_are_refused_not_read_out_of_bounds():
    block = Block(8, 64, 4, 2, 16, 96)
    step = make_step(17, [2], [3])
    with pytest.raises(Exception, match="outside the cache"):
        run_op(block, step, slots=np.array([0, 10 ** 6], np.int64))
    far = dict(step, positions=np.array([400, 401], np.int64))
    with pytest.raises(Exception, match="rotary tables"):
        run_op(block, far)


def test_serving_a_packed_shape_takes_the_fused_path():
    # NOTE: without this, a change that made FusedBlocks.of decline would pass every equality test
    # (the Paddle-op path computes the same function) and quietly give up the speed.
    model = make_model(0, **PACKED)
    kv = model.allocate_kv(model.config.num_hidden_layers, 8, 4)
    batch = pack([Window(ids=[1, 2, 3], start=0, blocks=[0])], block_size=4, max_blocks=2)
    ctx = PagedContext(batch, kv)
    first = model.model.layers[0]
    assert isinstance(first, DecoderLayer)
    assert fused_layer.FusedBlocks.of(ctx, model.rotary, first, 1) is not None
    assert fused_layer.FusedBlocks.of(ctx, model.rotary, first, 2) is None
    model.train()
    assert fused_layer.FusedBlocks.of(ctx, model.rotary, first, 1) is None


@pytest.mark.parametrize("zero_position_zero", [False, True])
def test_an_mtp_depth_in_one_call_matches_the_paddle_op_path(zero_position_zero):
    # NOTE: the dense context takes the Paddle-op path (project_inputs, the block, final_layernorm); the
    # paged one runs the whole depth, its input stage included, as one op.
    from mtpserve.model.attention_context import DenseCausalContext

    model = make_model(3, **PACKED, mtp_zero_position_zero=zero_position_zero)
    c = model.config
    n = 9
    ids = np.random.default_rng(4).integers(1, c.vocab_size, n + 1)
    kv = model.allocate_kv(c.num_hidden_layers, 8, 4)
    mtp_kv = model.allocate_kv(c.num_nextn_predict_layers, 8, 4)
    batch = pack([Window(ids=ids[:n].tolist(), start=0, blocks=[0, 1, 2])], block_size=4, max_blocks=4)
    hidden = model.forward(batch, kv).mtp_hidden
    shifted = paddle.to_tensor(ids[1:].astype(np.int64))
    fused = model.mtp_forward(0, batch, shifted, hidden, mtp_kv)
    dense = model.run_mtp(0, shifted, hidden, paddle.arange(n, dtype="int64"), DenseCausalContext(1, n))
    np.testing.assert_allclose(fused.mtp_hidden.numpy(), dense.mtp_hidden.numpy(), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(fused.hidden_states.numpy(), dense.hidden_states.numpy(), rtol=1e-4, atol=1e-4)


def test_a_float16_cache_is_written_rounded_as_numpy_rounds_and_read_back():
    """K/V columns scaled over 13 decades, so the writes hit float16's subnormals, normals and its top
    range: each written value is the float32 K/V the op computes, rounded exactly as NumPy rounds."""
    block = Block(9, 64, 4, 2, 16, 96)
    kv_cols = slice(block.heads * block.dim, None)
    block.qkv[:, kv_cols] *= 10.0 ** np.random.default_rng(1).uniform(-9, 4, block.qkv[:, kv_cols].shape[1])
    if block.qkv_bias is not None:
        block.qkv_bias[kv_cols] = 0.0
    step = make_step(19, [3, 1, 5], [9, 20, 2])
    _, k32, v32 = run_op(block, step)
    half = dict(step, k_cache=step["k_cache"].astype(np.float16), v_cache=step["v_cache"].astype(np.float16))
    got, k16, v16 = run_op(block, half)
    assert k16.dtype == np.float16
    written = np.asarray(step["slots"], np.int64)
    assert k16[written].tobytes() == k32[written].astype(np.float16).tobytes()
    assert v16[written].tobytes() == v32[written].astype(np.float16).tobytes()
    assert (np.abs(k16[written]) < 6.1e-5).any() and (np.abs(k16[written]) > 1e3).any()
    # NOTE: the float64 block over a float16 cache: its writes round there too
    want, _, _ = reference(block, half)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-3)


def test_float16_panels_compute_the_block_of_the_rounded_weights():
    """An MTP layer's weights may be packed in float16 (draft_weight_dtype): the op then computes the
    block of the weights as float16 rounds them, prefill and decode rows alike."""
    block = Block(21, 64, 4, 2, 16, 96)
    step = make_step(22, [3, 1, 5], [9, 20, 2])
    got, k_cache, _ = run_op(block, step, panels="float16")
    want, want_k, _ = reference(block.rounded(np.float16), step)
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(k_cache, want_k, rtol=2e-4, atol=2e-4)
    full, _, _ = run_op(block, step)
    assert not np.allclose(got, full, rtol=1e-6, atol=0)  # NOTE: the rounding is really there


@pytest.mark.parametrize("weights", ["float32", "float16"])
@pytest.mark.parametrize("draft_vocab", [None, 64])
def test_a_depth_drafting_inside_its_call_drafts_what_separate_calls_draft(draft_vocab, weights, monkeypatch):
    """draft_depth with the head in the layer op (one call) against run_mtp + gather + draft_token_ids:
    the same ids at the rows asked for, and the same hidden for the next depth; at the full vocabulary
    and at a draft vocabulary, with float32 and float16 draft weights."""
    model = make_model(7, **PACKED, vocab_size=128)
    if draft_vocab is not None:
        model.set_draft_vocab(np.random.default_rng(8).permutation(128)[:draft_vocab])
    model.set_draft_weight_dtype(weights)
    mtp_qkv = model.model.mtp_layers[0].self_attn.qkv.serving.panels
    assert mtp_qkv is not None and mtp_qkv.dtype == getattr(paddle, weights)
    assert model.model.layers[0].self_attn.qkv.serving.panels.dtype == paddle.float32
    c = model.config
    ids = np.random.default_rng(9).integers(1, c.vocab_size, 12)
    windows = [Window(ids=ids[:7].tolist(), start=0, blocks=[0, 1]), Window(ids=ids[7:11].tolist(), start=0, blocks=[2])]
    batch = pack(windows, block_size=4, max_blocks=2)
    hidden = model.forward(batch, model.allocate_kv(c.num_hidden_layers, 8, 4)).mtp_hidden
    shifted = paddle.to_tensor(ids[1:12].astype(np.int64))
    rows = paddle.to_tensor(np.array([2, 6, 10], np.int64))
    layers = c.num_nextn_predict_layers
    head = model._draft_head_panels(rows)
    mtp0 = model.model.mtp_layers[0]
    assert isinstance(mtp0, MTPLayer)
    assert head is not None and fused_layer.FusedBlocks.of(
        PagedContext(batch, model.allocate_kv(layers, 8, 4)), model.rotary, mtp0, 1) is not None
    for depth, out_rows, draft_rows in ((0, None, rows), (1, rows, None)):
        with monkeypatch.context() as patched:  # NOTE: the one-call path may not fall back to separate calls
            patched.setattr(mimo_model, "compose_draft_depth", None)
            one = model.draft_depth(depth, shifted, hidden, batch.positions,
                                    PagedContext(batch, model.allocate_kv(layers, 8, 4)), out_rows, draft_rows)
        apart = compose_draft_depth(model, depth, shifted, hidden, batch.positions,
                                    PagedContext(batch, model.allocate_kv(layers, 8, 4)), out_rows, draft_rows)
        assert one.draft_ids.shape == [3]
        np.testing.assert_array_equal(one.draft_ids.numpy(), apart.draft_ids.numpy())
        np.testing.assert_array_equal(one.mtp_hidden.numpy(), apart.mtp_hidden.numpy())
        if model.draft_head is not None:
            assert set(one.draft_ids.numpy().tolist()) <= set(model.draft_head.ids.numpy().tolist())


@pytest.mark.parametrize("after_norm", [False, True])
def test_the_last_block_with_the_lm_head_in_its_call_gives_the_logits_of_separate_calls(after_norm, monkeypatch):
    """forward_step with the final norm and the LM head inside the last block's call against run +
    gather + compute_logits: bit-equal logits at the rows asked for, their argmax, the same MTP input."""
    model = make_model(11, **PACKED, vocab_size=128, mtp_hidden_after_norm=after_norm)
    c = model.config
    ids = np.random.default_rng(12).integers(1, c.vocab_size, 11)
    batch = pack([Window(ids=ids[:7].tolist(), start=0, blocks=[0, 1]), Window(ids=ids[7:].tolist(), start=0, blocks=[2])],
                 block_size=4, max_blocks=2)
    rows = paddle.to_tensor(np.array([4, 5, 6, 10, 10], np.int64))
    with monkeypatch.context() as patched:  # NOTE: the one-call path may not fall back to separate calls
        patched.setattr(mimo_model, "compose_forward_step", None)
        one = model.forward_step(batch.input_ids, batch.positions,
                                 PagedContext(batch, model.allocate_kv(c.num_hidden_layers, 8, 4)), rows)
    apart = mimo_model.compose_forward_step(model, batch.input_ids, batch.positions,
                                            PagedContext(batch, model.allocate_kv(c.num_hidden_layers, 8, 4)), rows)
    assert one.logits.shape == [5, 128] and one.greedy is not None
    np.testing.assert_array_equal(one.logits.numpy(), apart.logits.numpy())
    np.testing.assert_array_equal(one.greedy.numpy(), apart.logits.numpy().argmax(-1))
    np.testing.assert_array_equal(one.mtp_hidden.numpy(), apart.mtp_hidden.numpy())


@pytest.mark.parametrize("fused", [True, False])
def test_a_step_that_wants_some_rows_gives_their_logits_and_hidden_as_a_whole_step(fused, monkeypatch):
    """forward_step with out_rows (the last block's MLP on those rows alone where the op serves, gathers
    in separate calls) against the whole step: bit-equal logits at the same token rows and the same
    hidden at out_rows, while every token's KV is still written (the next step reads it)."""
    model = make_model(13, **PACKED, vocab_size=128)
    c = model.config
    ids = np.random.default_rng(14).integers(1, c.vocab_size, 11)
    batch = pack([Window(ids=ids[:7].tolist(), start=0, blocks=[0, 1]), Window(ids=ids[7:].tolist(), start=0, blocks=[2])],
                 block_size=4, max_blocks=2)
    kept = np.array([3, 6, 10], np.int64)  # NOTE: a row the logits do not read (3) is kept as well
    logit_rows = np.array([6, 10, 10], np.int64)

    def step(out_rows):
        kv = model.allocate_kv(c.num_hidden_layers, 8, 4)
        ctx = PagedContext(batch, kv)
        with monkeypatch.context() as patched:
            if fused:  # NOTE: the one-call path may not fall back to separate calls
                patched.setattr(mimo_model, "compose_forward_step", None)
            else:
                patched.setattr(fused_layer, "available", lambda: False)
            if out_rows is None:
                out = model.forward_step(batch.input_ids, batch.positions, ctx, paddle.to_tensor(logit_rows))
            else:
                places = paddle.to_tensor(np.searchsorted(kept, logit_rows))
                out = model.forward_step(batch.input_ids, batch.positions, ctx, places, paddle.to_tensor(out_rows))
        return out, np.concatenate([kv.k[i].numpy() for i in range(c.num_hidden_layers)])

    whole, whole_kv = step(None)
    some, some_kv = step(kept)
    assert some.logits.shape == [3, 128] and some.mtp_hidden.shape == [3, c.hidden_size]
    np.testing.assert_array_equal(some.logits.numpy(), whole.logits.numpy())
    np.testing.assert_array_equal(some.mtp_hidden.numpy(), whole.mtp_hidden.numpy()[kept])
    np.testing.assert_array_equal(some_kv, whole_kv)
