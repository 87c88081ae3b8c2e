"""An independent NumPy implementation of the Qwen2 decoder with MiMo MTP layers (full recompute).

It reads weights by their Hugging Face names from a plain dict of arrays and recomputes every
sequence from scratch, with no KV cache, so it shares nothing with the Paddle code under test.
"""

from __future__ import annotations

import numpy as np


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    x64 = x.astype(np.float64)
    return x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + eps) * w


def rope(x: np.ndarray, positions: np.ndarray, theta: float) -> np.ndarray:
    """x: [S, heads, D]; rotate-half layout."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, d, 2) / d)
    ang = positions[:, None] * inv[None, :]  # [S, D/2]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def linear(x, w, b=None):
    y = x @ w.T
    return y if b is None else y + b


class Reference:
    def __init__(self, weights: dict[str, np.ndarray], cfg):
        self.w = {k: v.astype(np.float64) for k, v in weights.items()}
        self.cfg = cfg

    def attention(self, p: str, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
        c, w = self.cfg, self.w
        heads, kvh, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        s = x.shape[0]
        q = linear(x, w[p + "q_proj.weight"], w[p + "q_proj.bias"]).reshape(s, heads, d)
        k = linear(x, w[p + "k_proj.weight"], w[p + "k_proj.bias"]).reshape(s, kvh, d)
        v = linear(x, w[p + "v_proj.weight"], w[p + "v_proj.bias"]).reshape(s, kvh, d)
        q, k = rope(q, positions, c.rope_theta), rope(k, positions, c.rope_theta)
        rep = heads // kvh
        k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)  # [S, heads, D]
        scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(d)
        scores = np.where(np.tril(np.ones((s, s), bool))[None], scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        out = np.einsum("hqk,khd->qhd", probs, v).reshape(s, heads * d)
        return linear(out, w[p + "o_proj.weight"])

    def block(self, p: str, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
        w, eps = self.w, self.cfg.rms_norm_eps
        x = x + self.attention(p + "self_attn.", rms_norm(x, w[p + "input_layernorm.weight"], eps), positions)
        h = rms_norm(x, w[p + "post_attention_layernorm.weight"], eps)
        gate, up = linear(h, w[p + "mlp.gate_proj.weight"]), linear(h, w[p + "mlp.up_proj.weight"])
        return x + linear(gate / (1 + np.exp(-gate)) * up, w[p + "mlp.down_proj.weight"])

    def head(self, x: np.ndarray) -> np.ndarray:
        key = "model.embed_tokens.weight" if self.cfg.tie_word_embeddings else "lm_head.weight"
        return x @ self.w[key].T

    def main(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """ids: [S] -> (logits [S, V], pre-norm hidden [S, H])."""
        positions = np.arange(len(ids), dtype=np.float64)
        x = self.w["model.embed_tokens.weight"][ids]
        for i in range(self.cfg.num_hidden_layers):
            x = self.block(f"model.layers.{i}.", x, positions)
        return self.head(rms_norm(x, self.w["model.norm.weight"], self.cfg.rms_norm_eps)), x

    def mtp(self, i: int, next_ids: np.ndarray, prev_hidden: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """MTP layer i at positions 0..S-1: next_ids [S] are the tokens at t+1 (for depth 1)."""
        w, eps, p = self.w, self.cfg.rms_norm_eps, f"model.mtp_layers.{i}."
        positions = np.arange(len(next_ids), dtype=np.float64)
        raw = w["model.embed_tokens.weight"][next_ids].copy()
        if getattr(self.cfg, "mtp_zero_position_zero", False):  # vLLM's convention for real MiMo checkpoints
            raw[0] = 0.0
        emb = rms_norm(raw, w[p + "token_layernorm.weight"], eps)
        hid = rms_norm(prev_hidden, w[p + "hidden_layernorm.weight"], eps)
        x = linear(np.concatenate([hid, emb], -1), w[p + "input_proj.weight"])
        x = self.block(p, x, positions)
        return self.head(rms_norm(x, w[p + "final_layernorm.weight"], eps)), x
