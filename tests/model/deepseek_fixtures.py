"""A tiny DeepSeek-V3 checkpoint in the released layout, written from the layout's facts (tensor names,
shapes and config fields of DeepSeek-V3's config.json and model.safetensors.index.json), not from the
model class under test, so a name or shape the model gets wrong fails the load."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from family_harness import drafty
from safetensors.numpy import save_file

# Small sizes, every feature on: q LoRA, several expert groups, a dense first layer, YaRN with both
# mscales (one of them != 1, so the cos/sin factor and the softmax factor both differ from 1).
TINY_V3: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "vocab_size": 160,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 24,
    "num_hidden_layers": 3,
    "num_nextn_predict_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_shared_experts": 1,
    "n_routed_experts": 8,
    "routed_scaling_factor": 2.5,
    "kv_lora_rank": 24,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "v_head_dim": 12,
    "qk_nope_head_dim": 16,
    "topk_method": "noaux_tc",
    "n_group": 4,
    "topk_group": 2,
    "num_experts_per_tok": 3,
    "moe_layer_freq": 1,
    "first_k_dense_replace": 1,
    "norm_topk_prob": True,
    "scoring_func": "sigmoid",
    "hidden_act": "silu",
    "max_position_embeddings": 512,
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-6,
    "use_cache": True,
    "tie_word_embeddings": False,
    "rope_theta": 10000,
    "rope_scaling": {"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64,
                     "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.707},
    "attention_bias": False,
    "attention_dropout": 0.0,
    "torch_dtype": "float32",
}


def tensor_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor of the checkpoint with its shape ([out, in] for linears)."""
    h, v, heads = cfg["hidden_size"], cfg["vocab_size"], cfg["num_attention_heads"]
    nope, rope, vd = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    r, qr = cfg["kv_lora_rank"], cfg["q_lora_rank"]
    n = cfg["num_hidden_layers"]
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,),
                                          "lm_head.weight": (v, h)}
    for i in range(n + cfg["num_nextn_predict_layers"]):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                   p + "self_attn.q_a_proj.weight": (qr, h), p + "self_attn.q_a_layernorm.weight": (qr,),
                   p + "self_attn.q_b_proj.weight": (heads * (nope + rope), qr),
                   p + "self_attn.kv_a_proj_with_mqa.weight": (r + rope, h),
                   p + "self_attn.kv_a_layernorm.weight": (r,),
                   p + "self_attn.kv_b_proj.weight": (heads * (nope + vd), r),
                   p + "self_attn.o_proj.weight": (h, heads * vd)}
        if i >= cfg["first_k_dense_replace"] and i % cfg["moe_layer_freq"] == 0:
            e, mi = cfg["n_routed_experts"], cfg["moe_intermediate_size"]
            shapes |= {p + "mlp.gate.weight": (e, h), p + "mlp.gate.e_score_correction_bias": (e,)}
            for j in range(e):
                shapes |= _mlp(p + f"mlp.experts.{j}.", h, mi)
            shapes |= _mlp(p + "mlp.shared_experts.", h, mi * cfg["n_shared_experts"])
        else:
            shapes |= _mlp(p + "mlp.", h, cfg["intermediate_size"])
        if i >= n:
            shapes |= {p + "embed_tokens.weight": (v, h), p + "enorm.weight": (h,), p + "hnorm.weight": (h,),
                       p + "eh_proj.weight": (h, 2 * h), p + "shared_head.norm.weight": (h,),
                       p + "shared_head.head.weight": (v, h)}
    return shapes


def _mlp(prefix: str, h: int, inner: int) -> dict[str, tuple[int, ...]]:
    return {prefix + "gate_proj.weight": (inner, h), prefix + "up_proj.weight": (inner, h),
            prefix + "down_proj.weight": (h, inner)}


def random_tensors(cfg: dict[str, Any], seed: int = 0) -> dict[str, np.ndarray]:
    """Norm weights around 1, the rest random and large enough for sharp, well-separated logits."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in tensor_shapes(cfg).items():
        if name.endswith("norm.weight"):
            value = 1.0 + 0.2 * rng.standard_normal(shape)
        elif name.endswith("e_score_correction_bias"):
            value = 0.3 * rng.standard_normal(shape)
        else:
            # NOTE: heads smaller: logits of magnitude ~5 keep float32's rounding well under 1e-4
            gain = 0.5 if name.endswith("head.weight") else 1.5
            value = rng.standard_normal(shape) / np.sqrt(shape[-1]) * gain
        out[name] = value.astype(np.float32)
    return out


def write_checkpoint(directory: Path, cfg: dict[str, Any] | None = None, seed: int = 0,
                     tensors: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """config.json + model.safetensors; returns the tensors written."""
    cfg = cfg or TINY_V3
    tensors = tensors if tensors is not None else random_tensors(cfg, seed)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return tensors


def drafty_tensors(cfg: dict[str, Any] | None = None, seed: int = 0) -> dict[str, np.ndarray]:
    """Random tensors whose MTP module drafts what the main model then emits (family_harness.drafty)."""
    cfg = cfg or TINY_V3
    mtp = f"model.layers.{cfg['num_hidden_layers']}."
    return drafty(random_tensors(cfg, seed), vocab=cfg["vocab_size"], hidden=cfg["hidden_size"],
                  damped_prefixes=("model.layers.",), heads=("lm_head.weight", mtp + "shared_head.head.weight"),
                  embeddings=("model.embed_tokens.weight", mtp + "embed_tokens.weight"),
                  projections=(mtp + "eh_proj.weight",), seed=seed)
