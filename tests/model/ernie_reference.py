"""An independent NumPy (float64) forward of ERNIE-4.5 MoE and its MTP block, written from the published
descriptions (the model card's architecture, FastDeploy's ernie4_5_moe / ernie4_5_mtp files for names,
order and which norms apply), over the "-PT" release's tensor names. Whole sequences, causal masks,
rope as complex rotations of consecutive pairs; no code shared with the model under test."""

from __future__ import annotations

from typing import Any

import numpy as np
from deepseek_reference import ffn, rms
from ernie_fixtures import is_moe

W = dict[str, np.ndarray]


def rope_pairs(x: np.ndarray, positions: np.ndarray, theta: float) -> np.ndarray:
    """x [S, heads, d]: pair (x[2i], x[2i+1]) turned by position * theta^(-2i/d)."""
    d = x.shape[-1]
    angle = positions[:, None] * theta ** (-np.arange(0, d, 2) / d)  # [S, d/2]
    z = (x[..., 0::2] + 1j * x[..., 1::2]) * np.exp(1j * angle)[:, None, :]
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = z.real, z.imag
    return out


def attention(w: W, p: str, cfg: dict[str, Any], x: np.ndarray, positions: np.ndarray) -> np.ndarray:
    s, d = x.shape[0], cfg["head_dim"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    q = rope_pairs((x @ w[p + "q_proj.weight"].T).reshape(s, heads, d), positions, cfg["rope_theta"])
    k = rope_pairs((x @ w[p + "k_proj.weight"].T).reshape(s, kv, d), positions, cfg["rope_theta"])
    v = (x @ w[p + "v_proj.weight"].T).reshape(s, kv, d)
    k, v = np.repeat(k, heads // kv, axis=1), np.repeat(v, heads // kv, axis=1)  # head h reads KV head h // G
    scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(d)
    scores = np.where(np.tril(np.ones((s, s), bool))[None], scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", probs, v).reshape(s, heads * d) @ w[p + "o_proj.weight"].T


def moe(w: W, p: str, cfg: dict[str, Any], x: np.ndarray) -> np.ndarray:
    logits = x @ w[p + "gate.weight"].T
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = ffn(w, p + "shared_experts.", x) if cfg["moe_num_shared_experts"] else np.zeros_like(x)
    for t in range(x.shape[0]):
        chosen = np.argsort(-(probs[t] + w[p + "moe_statics.e_score_correction_bias"][0]), kind="stable")[:cfg["moe_k"]]
        g = probs[t, chosen] / max(probs[t, chosen].sum(), cfg["moe_norm_min"])
        for gate, j in zip(g, chosen):
            out[t] += gate * ffn(w, p + f"experts.{j}.", x[t:t + 1])[0]
    return out


def block(w: W, p: str, moe_layer: bool, cfg: dict[str, Any], h: np.ndarray, positions: np.ndarray) -> np.ndarray:
    eps = cfg["rms_norm_eps"]
    h = h + attention(w, p + "self_attn.", cfg, rms(h, w[p + "input_layernorm.weight"], eps), positions)
    x = rms(h, w[p + "post_attention_layernorm.weight"], eps)
    return h + (moe(w, p + "mlp.", cfg, x) if moe_layer else ffn(w, p + "mlp.", x))


def head(w: W, cfg: dict[str, Any]) -> np.ndarray:
    return w["model.embed_tokens.weight"] if cfg["tie_word_embeddings"] else w["lm_head.weight"]


def main_model(w: W, cfg: dict[str, Any], tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """tokens [S] -> (logits [S, V], the hidden after model.norm [S, H])."""
    w = {k: v.astype(np.float64) for k, v in w.items()}
    positions = np.arange(len(tokens), dtype=np.float64)
    h = w["model.embed_tokens.weight"][tokens]
    for i in range(cfg["num_hidden_layers"]):
        h = block(w, f"model.layers.{i}.", is_moe(cfg, i), cfg, h, positions)
    normed = rms(h, w["model.norm.weight"], cfg["rms_norm_eps"])
    return normed @ head(w, cfg).T, normed


def mtp_depths(w: W, cfg: dict[str, Any], tokens: np.ndarray, k: int) -> list[np.ndarray]:
    """Draft logits of depths 1..k (depth d at position t predicts token t+d+1): h' = mtp_linear_proj
    [mtp_emb_norm(Emb(t_{t+d})); mtp_hidden_norm(prev_t)], the block, model.norm, the shared head; the
    normed output is the next depth's prev (FastDeploy); depth 1's prev is the normed main hidden."""
    _, prev = main_model(w, cfg, tokens)
    w = {k_: v.astype(np.float64) for k_, v in w.items()}
    eps, out = cfg["rms_norm_eps"], []
    for d in range(1, k + 1):
        j = (d - 1) % cfg["num_nextn_predict_layers"]
        length = len(tokens) - d
        emb = w["model.embed_tokens.weight"][tokens[d:]]
        joined = np.concatenate([rms(emb, w[f"model.mtp_emb_norm.{j}.weight"], eps),
                                 rms(prev[:length], w[f"model.mtp_hidden_norm.{j}.weight"], eps)], -1)
        h = block(w, f"model.mtp_block.{j}.", is_moe(cfg, 0), cfg, joined @ w[f"model.mtp_linear_proj.{j}.weight"].T,
                  np.arange(length, dtype=np.float64))
        prev = rms(h, w["model.norm.weight"], eps)
        out.append(prev @ head(w, cfg).T)
    return out
