"""The reduced draft vocabulary: drafts are full-vocabulary ids from the subset, the subset's argmax."""

from __future__ import annotations

import json

import numpy as np
import paddle
import pytest

from model_fixtures import TINY, make_model
from mtpserve.model.checkpoint import save_checkpoint
from mtpserve.model.draft_vocab import DRAFT_VOCAB_FILE, DraftHead, DraftVocabError, read_draft_vocab
from mtpserve.model.loader import DEFAULT_MODEL_DIR, load_model
from mtpserve.model.config import ModelConfig
from mtpserve.model.mimo_model import MiMoForCausalLM
from mtpserve.model.parallel import TensorParallel

VOCAB = TINY["vocab_size"]


def subset(seed: int, size: int = 30) -> np.ndarray:
    return np.random.default_rng(seed).permutation(VOCAB)[:size].astype(np.int64)


def hidden(seed: int, rows: int = 200) -> paddle.Tensor:
    return paddle.to_tensor(np.random.default_rng(seed).standard_normal((rows, TINY["hidden_size"]))
                            .astype(np.float32))


def test_drafts_are_the_argmax_over_the_subset_as_full_ids():
    model = make_model(1)
    h = hidden(2)
    logits = model.compute_logits(h).numpy()  # [M, V]
    ids = subset(3)
    model.set_draft_vocab(ids)
    drafts = model.draft_token_ids(h).numpy()
    assert drafts.dtype == np.int64 and np.isin(drafts, ids).all()
    np.testing.assert_array_equal(drafts, ids[logits[:, ids].argmax(-1)])


def test_drafts_equal_the_full_argmax_whenever_it_is_in_the_subset():
    model = make_model(4)
    h = hidden(5)
    full = model.draft_token_ids(h).numpy()
    ids = subset(6, size=60)
    model.set_draft_vocab(ids)
    reduced = model.draft_token_ids(h).numpy()
    inside = np.isin(full, ids)
    assert 0 < inside.sum() < inside.size  # both cases occur, so the check below can fail
    np.testing.assert_array_equal(reduced[inside], full[inside])
    assert np.isin(reduced, ids).all()
    model.set_draft_vocab(None)
    np.testing.assert_array_equal(model.draft_token_ids(h).numpy(), full)


def test_training_mode_reads_the_live_head_and_eval_rebuilds_the_copy():
    model = make_model(7)
    ids = subset(8)
    model.set_draft_vocab(ids)
    h = hidden(9)
    frozen = model.draft_token_ids(h).numpy()
    model.train()
    np.testing.assert_array_equal(model.draft_token_ids(h).numpy(), frozen)
    with paddle.no_grad():
        weight = model.model.embed_tokens.weight
        weight.set_value(weight * -1.0)  # tied head: the subset's argmax becomes its argmin
    flipped = model.draft_token_ids(h).numpy()
    assert (flipped != frozen).mean() > 0.5
    model.eval()
    np.testing.assert_array_equal(model.draft_token_ids(h).numpy(), flipped)


def test_tensor_parallel_shards_sum_to_the_single_rank_subset_weight():
    """Each rank keeps the subset rows it owns and zeros elsewhere: their all-reduce sum is exact."""
    config = ModelConfig(**{**TINY, "vocab_size": 96})
    ids = np.random.default_rng(10).permutation(96)[:40].astype(np.int64)
    single = MiMoForCausalLM(config)
    full = single.lm_head._weight().numpy()  # [V, H]
    total = np.zeros((ids.size, full.shape[1]), np.float32)
    for rank in range(2):
        tp = TensorParallel(rank=rank, size=2)
        shard = MiMoForCausalLM(config, tp)
        rows = full[rank * 48:(rank + 1) * 48]
        shard.model.embed_tokens.weight.set_value(paddle.to_tensor(rows))
        part = DraftHead(ids, shard.lm_head, tp)._subset_weight().numpy()  # [N, H]
        owned = (ids >= rank * 48) & (ids < (rank + 1) * 48)
        assert not part[~owned].any()
        total += part
    np.testing.assert_array_equal(total, full[ids])


def test_draft_vocab_file_is_optional_and_checked(tmp_path):
    model = make_model(11)
    save_checkpoint(model, tmp_path)
    assert read_draft_vocab(tmp_path, VOCAB) is None
    assert load_model(tmp_path).draft_head is None
    ids = subset(12)
    (tmp_path / DRAFT_VOCAB_FILE).write_text(json.dumps({"token_ids": ids.tolist()}))
    loaded = load_model(tmp_path)
    assert loaded.draft_head is not None
    np.testing.assert_array_equal(loaded.draft_head.ids.numpy(), ids)
    assert load_model(tmp_path, draft_vocab=False).draft_head is None
    for bad in ([VOCAB], [-1, 2], [3, 3], []):
        (tmp_path / DRAFT_VOCAB_FILE).write_text(json.dumps({"token_ids": bad}))
        with pytest.raises(DraftVocabError):
            load_model(tmp_path)


@pytest.mark.skipif(not (DEFAULT_MODEL_DIR / DRAFT_VOCAB_FILE).exists(), reason="no bundled draft vocabulary")
def test_bundled_draft_vocab_is_valid_and_keeps_eos():
    config = json.loads((DEFAULT_MODEL_DIR / "config.json").read_text())
    ids = read_draft_vocab(DEFAULT_MODEL_DIR, config["vocab_size"])
    assert ids is not None and 0 < ids.size < config["vocab_size"]
    assert config["eos_token_id"] in ids.tolist()
