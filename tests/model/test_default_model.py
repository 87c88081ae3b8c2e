"""The bundled default model: it loads, fits the size budget, and has learned held-out code."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import paddle
import pytest

from mtpserve.model.attention_context import DenseCausalContext
from mtpserve.model.loader import DEFAULT_MODEL_DIR, load_model
from mtpserve.tokenizer import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from stdlib_corpus import read_text, split_files  # noqa: E402

pytestmark = pytest.mark.skipif(not (DEFAULT_MODEL_DIR / "model.safetensors").exists(),
                                reason="default model weights not built yet")
MAX_WEIGHT_BYTES = 25 * 1024 * 1024


def test_default_model_fits_the_budget_and_its_layout():
    assert (DEFAULT_MODEL_DIR / "model.safetensors").stat().st_size <= MAX_WEIGHT_BYTES
    config = json.loads((DEFAULT_MODEL_DIR / "config.json").read_text())
    assert config["architectures"] == ["MiMoForCausalLM"]
    assert config["num_nextn_predict_layers"] >= 1
    for name in ("tokenizer.json", "tokenizer_config.json", "README.md"):
        assert (DEFAULT_MODEL_DIR / name).exists(), name


def test_default_model_beats_a_unigram_model_on_heldout_code():
    """Cross-entropy on a held-out stdlib file beats a unigram model fitted to that very text.

    The unigram baseline is given the answer (its counts come from the scored tokens), so a model
    that only learned token frequencies cannot pass; context is needed.
    """
    model = load_model(DEFAULT_MODEL_DIR)
    tokenizer = Tokenizer.from_model_dir(DEFAULT_MODEL_DIR)
    ids = np.array(tokenizer.encode(read_text(split_files()[1][0]), add_special_tokens=False)[:257])
    counts = np.bincount(ids[1:])
    unigram = -(counts[counts > 0] / 256 * np.log(counts[counts > 0] / 256)).sum()
    with paddle.no_grad():
        out = model.run(paddle.to_tensor(ids[:-1]), paddle.arange(256, dtype="int64"), DenseCausalContext(1, 256))
        ce = paddle.nn.functional.cross_entropy(model.compute_logits(out.hidden_states),
                                                paddle.to_tensor(ids[1:]).unsqueeze(-1)).mean()
    assert float(ce) < unigram, (float(ce), unigram)
    assert math.isfinite(float(ce))
