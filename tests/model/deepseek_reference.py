"""An independent NumPy (float64) forward of DeepSeek-V3 and its MTP module, written from the DeepSeek-V3
technical report (arXiv 2412.19437: MLA eqs. 1-11, DeepSeekMoE eqs. 12-16 with the V3 config's
group-limited routing, MTP eqs. 21-25) and YaRN (arXiv 2309.00071), over the released checkpoint's
tensor names. It shares no code with the model under test: attention is computed with the per-head
keys and values expanded (no weight absorption, no latent cache), rope rotates consecutive pairs as
complex numbers (DeepSeek's layout), and everything runs over one whole sequence at once.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

W = dict[str, np.ndarray]


def rms(x: np.ndarray, w: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1 + np.exp(-x))


def yarn(cfg: dict[str, Any]) -> tuple[np.ndarray, float, float]:
    """(inverse frequencies [rope/2], cos/sin magnitude, softmax scale) from config.json."""
    dim, base = cfg["qk_rope_head_dim"], float(cfg["rope_theta"])
    freqs = 1.0 / base ** (np.arange(0, dim, 2) / dim)
    scale = (cfg["qk_nope_head_dim"] + dim) ** -0.5
    rs = cfg.get("rope_scaling")
    if not rs:
        return freqs, 1.0, scale
    factor, orig = rs["factor"], rs["original_max_position_embeddings"]

    def dim_for(rotations: float) -> float:  # the dimension that turns `rotations` times over `orig`
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = max(math.floor(dim_for(rs["beta_fast"])), 0), min(math.ceil(dim_for(rs["beta_slow"])), dim - 1)
    ramp = np.clip((np.arange(dim // 2) - low) / max(high - low, 1e-3), 0, 1)  # 0: keep, 1: interpolate
    freqs = freqs * (1 - ramp) + freqs / factor * ramp

    def m(s: float) -> float:
        return 0.1 * s * math.log(factor) + 1 if factor > 1 else 1.0

    magnitude = m(rs["mscale"]) / m(rs["mscale_all_dim"])
    return freqs, magnitude, scale * m(rs["mscale_all_dim"]) ** 2


def rope_pairs(x: np.ndarray, positions: np.ndarray, freqs: np.ndarray, magnitude: float) -> np.ndarray:
    """x [S, ..., d]: pair (x[2i], x[2i+1]) is a complex number turned by position * freqs[i]."""
    z = x[..., 0::2] + 1j * x[..., 1::2]
    angle = positions[:, None] * freqs[None, :]  # [S, d/2]
    turn = (magnitude * np.exp(1j * angle)).reshape(angle.shape[0], *([1] * (x.ndim - 2)), -1)
    z = z * turn
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = z.real, z.imag
    return out


def mla(w: W, p: str, cfg: dict[str, Any], h: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Causal MLA over the whole sequence h [S, H]."""
    s, heads = h.shape[0], cfg["num_attention_heads"]
    nope, rd, vd, r = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"], cfg["kv_lora_rank"]
    freqs, magnitude, scale = yarn(cfg)
    c_q = rms(h @ w[p + "q_a_proj.weight"].T, w[p + "q_a_layernorm.weight"])
    q = (c_q @ w[p + "q_b_proj.weight"].T).reshape(s, heads, nope + rd)
    q_c, q_r = q[..., :nope], rope_pairs(q[..., nope:], positions, freqs, magnitude)
    kv = h @ w[p + "kv_a_proj_with_mqa.weight"].T
    c_kv = rms(kv[:, :r], w[p + "kv_a_layernorm.weight"])
    k_r = rope_pairs(kv[:, None, r:], positions, freqs, magnitude)  # [S, 1, rd], shared by every head
    up = (c_kv @ w[p + "kv_b_proj.weight"].T).reshape(s, heads, nope + vd)
    k_c, v = up[..., :nope], up[..., nope:]
    scores = (np.einsum("qhd,khd->hqk", q_c, k_c) + np.einsum("qhd,kxd->hqk", q_r, k_r)) * scale
    scores = np.where(np.tril(np.ones((s, s), bool))[None], scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    o = np.einsum("hqk,khd->qhd", probs, v).reshape(s, heads * vd)
    return o @ w[p + "o_proj.weight"].T


def ffn(w: W, p: str, x: np.ndarray) -> np.ndarray:
    return (silu(x @ w[p + "gate_proj.weight"].T) * (x @ w[p + "up_proj.weight"].T)) @ w[p + "down_proj.weight"].T


def moe(w: W, p: str, cfg: dict[str, Any], x: np.ndarray) -> np.ndarray:
    e, groups = cfg["n_routed_experts"], cfg["n_group"]
    s = 1 / (1 + np.exp(-(x @ w[p + "gate.weight"].T)))  # [S, E] affinities
    out = ffn(w, p + "shared_experts.", x)
    for t in range(x.shape[0]):
        biased = s[t] + w[p + "gate.e_score_correction_bias"]  # the bias selects, it never weighs
        per_group = np.sort(biased.reshape(groups, e // groups), axis=-1)[:, -2:].sum(-1)
        kept = np.argsort(-per_group, kind="stable")[:cfg["topk_group"]]
        allowed = np.isin(np.arange(e) // (e // groups), kept)
        chosen = np.argsort(-np.where(allowed, biased, -np.inf), kind="stable")[:cfg["num_experts_per_tok"]]
        g = s[t, chosen] / s[t, chosen].sum() if cfg["norm_topk_prob"] else s[t, chosen]
        for gate, j in zip(g * cfg["routed_scaling_factor"], chosen):
            out[t] += gate * ffn(w, p + f"experts.{j}.", x[t:t + 1])[0]
    return out


def block(w: W, i: int, cfg: dict[str, Any], h: np.ndarray, positions: np.ndarray) -> np.ndarray:
    p = f"model.layers.{i}."
    h = h + mla(w, p + "self_attn.", cfg, rms(h, w[p + "input_layernorm.weight"], cfg["rms_norm_eps"]), positions)
    x = rms(h, w[p + "post_attention_layernorm.weight"], cfg["rms_norm_eps"])
    is_moe = i >= cfg["first_k_dense_replace"] and i % cfg["moe_layer_freq"] == 0
    return h + (moe(w, p + "mlp.", cfg, x) if is_moe else ffn(w, p + "mlp.", x))


def main_model(w: W, cfg: dict[str, Any], tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """tokens [S] -> (logits [S, V], the final hidden after model.norm [S, H])."""
    w = {k: v.astype(np.float64) for k, v in w.items()}
    positions = np.arange(len(tokens), dtype=np.float64)
    h = w["model.embed_tokens.weight"][tokens]
    for i in range(cfg["num_hidden_layers"]):
        h = block(w, i, cfg, h, positions)
    normed = rms(h, w["model.norm.weight"], cfg["rms_norm_eps"])
    return normed @ w["lm_head.weight"].T, normed


def mtp_depths(w: W, cfg: dict[str, Any], tokens: np.ndarray, k: int, zero_position_zero: bool = True
               ) -> list[np.ndarray]:
    """Draft logits of depths 1..k: depth d at position t (t < S-d) predicts token t+d+1.

    Report eq. 21 with the released checkpoint's order: h'_t = eh_proj [enorm(Emb(t_{t+d})); hnorm(h^{d-1}_t)]
    (embedding first; the report writes the hidden first), h^0 = the main model's normed final hidden,
    h^d = Trm(h'), logits = shared_head.head(shared_head.norm(h^d)); k > 1 applies the one module again.
    """
    _, prev = main_model(w, cfg, tokens)
    w64 = {k_: v.astype(np.float64) for k_, v in w.items()}
    n, eps = cfg["num_hidden_layers"], cfg["rms_norm_eps"]
    out = []
    for d in range(1, k + 1):
        i = n + (d - 1) % cfg["num_nextn_predict_layers"]
        p = f"model.layers.{i}."
        length = len(tokens) - d
        positions = np.arange(length, dtype=np.float64)
        emb = w64[p + "embed_tokens.weight"][tokens[d:]]
        if zero_position_zero:
            emb[0] = 0.0
        joined = np.concatenate([rms(emb, w64[p + "enorm.weight"], eps), rms(prev[:length], w64[p + "hnorm.weight"], eps)], -1)
        h = block(w64, i, cfg, joined @ w64[p + "eh_proj.weight"].T, positions)
        out.append(rms(h, w64[p + "shared_head.norm.weight"], eps) @ w64[p + "shared_head.head.weight"].T)
        prev = h
    return out
