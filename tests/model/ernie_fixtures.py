"""A tiny ERNIE-4.5 MoE checkpoint in the Hugging Face ("-PT") release's layout, written from the layout's
facts (tensor names, shapes, config fields), not from the model class under test."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from family_harness import drafty
from safetensors.numpy import save_file

# Small sizes, every feature on: GQA, a dense first layer, MoE layers with shared experts and an
# interval of 1 up to the last layer, untied head, one MTP block.
TINY_ERNIE: dict[str, Any] = {
    "architectures": ["Ernie4_5_MoeForCausalLM"],
    "model_type": "ernie4_5_moe",
    "vocab_size": 160,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "hidden_act": "silu",
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "use_bias": False,
    "moe_intermediate_size": 24,
    "moe_num_experts": 8,
    "moe_num_shared_experts": 2,
    "moe_k": 3,
    "moe_layer_start_index": 1,
    "moe_layer_end_index": -1,
    "moe_layer_interval": 1,
    "moe_norm_min": 1e-12,
    "num_nextn_predict_layers": 1,
    "torch_dtype": "float32",
}


def _mlp(prefix: str, h: int, inner: int) -> dict[str, tuple[int, ...]]:
    return {prefix + "gate_proj.weight": (inner, h), prefix + "up_proj.weight": (inner, h),
            prefix + "down_proj.weight": (h, inner)}


def _block(p: str, cfg: dict[str, Any], moe: bool) -> dict[str, tuple[int, ...]]:
    h, d = cfg["hidden_size"], cfg["head_dim"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    shapes = {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
              p + "self_attn.q_proj.weight": (heads * d, h), p + "self_attn.k_proj.weight": (kv * d, h),
              p + "self_attn.v_proj.weight": (kv * d, h), p + "self_attn.o_proj.weight": (h, heads * d)}
    if not moe:
        return shapes | _mlp(p + "mlp.", h, cfg["intermediate_size"])
    e, mi = cfg["moe_num_experts"], cfg["moe_intermediate_size"]
    shapes |= {p + "mlp.gate.weight": (e, h), p + "mlp.moe_statics.e_score_correction_bias": (1, e)}
    for j in range(e):
        shapes |= _mlp(p + f"mlp.experts.{j}.", h, mi)
    return shapes | _mlp(p + "mlp.shared_experts.", h, mi * cfg["moe_num_shared_experts"])


def is_moe(cfg: dict[str, Any], i: int) -> bool:
    end = cfg["num_hidden_layers"] - 1 if cfg["moe_layer_end_index"] == -1 else cfg["moe_layer_end_index"]
    return (i + 1) % cfg["moe_layer_interval"] == 0 and cfg["moe_layer_start_index"] <= i <= end


def tensor_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not cfg["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (v, h)
    for i in range(cfg["num_hidden_layers"]):
        shapes |= _block(f"model.layers.{i}.", cfg, is_moe(cfg, i))
    for j in range(cfg["num_nextn_predict_layers"]):
        shapes |= {f"model.mtp_emb_norm.{j}.weight": (h,), f"model.mtp_hidden_norm.{j}.weight": (h,),
                   f"model.mtp_linear_proj.{j}.weight": (h, 2 * h)}
        shapes |= _block(f"model.mtp_block.{j}.", cfg, is_moe(cfg, 0))
    return shapes


def random_tensors(cfg: dict[str, Any], seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in tensor_shapes(cfg).items():
        if name.endswith("norm.weight") or "_norm." in name:
            value = 1.0 + 0.2 * rng.standard_normal(shape)
        elif name.endswith("e_score_correction_bias"):
            value = 0.05 * rng.standard_normal(shape)
        else:
            gain = 0.5 if name in ("lm_head.weight", "model.embed_tokens.weight") else 1.5
            value = rng.standard_normal(shape) / np.sqrt(shape[-1]) * gain
        out[name] = value.astype(np.float32)
    return out


def write_checkpoint(directory: Path, cfg: dict[str, Any] | None = None, seed: int = 0,
                     tensors: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    cfg = cfg or TINY_ERNIE
    tensors = tensors if tensors is not None else random_tensors(cfg, seed)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return tensors


def drafty_tensors(cfg: dict[str, Any] | None = None, seed: int = 0) -> dict[str, np.ndarray]:
    """Random tensors whose MTP block drafts what the main model then emits (family_harness.drafty)."""
    cfg = cfg or TINY_ERNIE
    return drafty(random_tensors(cfg, seed), vocab=cfg["vocab_size"], hidden=cfg["hidden_size"],
                  damped_prefixes=("model.layers.", "model.mtp_block."), heads=("lm_head.weight",),
                  embeddings=("model.embed_tokens.weight",),
                  projections=tuple(f"model.mtp_linear_proj.{j}.weight" for j in range(cfg["num_nextn_predict_layers"])),
                  seed=seed)
