"""MiMo's MTP conventions as declared checkpoint properties: a tiny random checkpoint in the real MiMo
layout (tensor names and config fields of the release, no mtpserve fields) takes the real models'
conventions (depth 1 reads the pre-norm hidden, the position-0 token embedding is zeroed: vLLM's
runner), and its draft logits equal a NumPy reference written from them; the bundled model declares
the other convention in its config.json and keeps it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import paddle
import pytest
from numpy_reference import Reference
from safetensors.numpy import save_file

from mtpserve.model.attention_context import DenseCausalContext
from mtpserve.model.config import ModelConfig
from mtpserve.model.loader import DEFAULT_MODEL_DIR, load_serving_model
from mtpserve.model.mimo_model import MiMoForCausalLM

REAL_MIMO_CONFIG = {  # MiMo-7B's config.json fields, small sizes; nothing mtpserve-specific
    "architectures": ["MiMoForCausalLM"], "model_type": "mimo", "vocab_size": 97, "hidden_size": 48,
    "intermediate_size": 80, "num_hidden_layers": 2, "num_attention_heads": 6, "num_key_value_heads": 2,
    "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 640000.0, "tie_word_embeddings": False,
    "attention_bias": True, "num_nextn_predict_layers": 1, "hidden_act": "silu", "torch_dtype": "float32",
}


def real_layout(cfg: dict, seed: int = 0) -> dict[str, np.ndarray]:
    h, v, i, d = cfg["hidden_size"], cfg["vocab_size"], cfg["intermediate_size"], cfg["hidden_size"] // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * d

    def block(p: str) -> dict[str, tuple[int, ...]]:
        return {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (h, h), p + "self_attn.q_proj.bias": (h,),
                p + "self_attn.k_proj.weight": (kv, h), p + "self_attn.k_proj.bias": (kv,),
                p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.v_proj.bias": (kv,),
                p + "self_attn.o_proj.weight": (h, h), p + "mlp.gate_proj.weight": (i, h),
                p + "mlp.up_proj.weight": (i, h), p + "mlp.down_proj.weight": (h, i)}

    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,), "lm_head.weight": (v, h)}
    for n in range(cfg["num_hidden_layers"]):
        shapes |= block(f"model.layers.{n}.")
    for j in range(cfg["num_nextn_predict_layers"]):
        p = f"model.mtp_layers.{j}."
        shapes |= block(p) | {p + "token_layernorm.weight": (h,), p + "hidden_layernorm.weight": (h,),
                              p + "input_proj.weight": (h, 2 * h), p + "final_layernorm.weight": (h,)}
    rng = np.random.default_rng(seed)
    return {name: ((1.0 + 0.2 * rng.standard_normal(s)) if name.endswith("norm.weight")
                   else 0.15 * rng.standard_normal(s)).astype(np.float32) for name, s in shapes.items()}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[Path, dict[str, np.ndarray]]:
    directory = tmp_path_factory.mktemp("mimo_real")
    tensors = real_layout(REAL_MIMO_CONFIG)
    (directory / "config.json").write_text(json.dumps(REAL_MIMO_CONFIG))
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory, tensors


def draft_logits(model: MiMoForCausalLM, ids: np.ndarray) -> np.ndarray:
    n = len(ids) - 1
    tokens = paddle.to_tensor(ids.astype(np.int64))
    out = model.run(tokens[:n], paddle.arange(n, dtype="int64"), DenseCausalContext(1, n))
    d1 = model.run_mtp(0, tokens[1:], out.mtp_hidden, paddle.arange(n, dtype="int64"), DenseCausalContext(1, n))
    return model.compute_logits(d1.hidden_states).numpy()


def test_a_real_layout_checkpoint_takes_the_real_conventions_and_matches_numpy(checkpoint):
    model = load_serving_model(checkpoint[0])
    assert isinstance(model, MiMoForCausalLM)
    assert model.config.mtp_zero_position_zero and not model.config.mtp_hidden_after_norm
    ids = np.random.default_rng(3).integers(0, 97, 14)
    ref = Reference(checkpoint[1], model.config)
    expected, _ = ref.mtp(0, ids[1:], ref.main(ids[:-1])[1])
    got = draft_logits(model, ids)
    assert np.abs(got - expected).max() < 1e-4
    # the convention is live: without the zeroing only position 0's draft changes
    plain = Reference(checkpoint[1], ModelConfig.from_dict({**REAL_MIMO_CONFIG, "mtp_zero_position_zero": False}))
    unzeroed, _ = plain.mtp(0, ids[1:], plain.main(ids[:-1])[1])
    assert np.abs(unzeroed[0] - got[0]).max() > 1e-3
    assert np.abs(unzeroed[1:] - got[1:]).max() > 1e-6  # later positions attend to position 0's MTP KV


def test_the_bundled_model_declares_its_own_conventions():
    raw = json.loads((DEFAULT_MODEL_DIR / "config.json").read_text())
    config = ModelConfig.from_dict(raw)
    assert config.mtp_zero_position_zero is False and config.mtp_hidden_after_norm is False
