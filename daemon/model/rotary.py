"""Rotary position embedding in the Hugging Face "rotate half" layout that Qwen2 checkpoints use."""

from __future__ import annotations

import paddle


class RotaryEmbedding:
    """Applies RoPE at arbitrary positions, so prefill chunks, decode and verify share one code path."""

    def __init__(self, head_dim: int, theta: float):
        exponents = paddle.arange(0, head_dim, 2, dtype="float32") / head_dim
        self.inv_freq = 1.0 / (theta ** exponents)  # [D/2]

    def cos_sin(self, positions: paddle.Tensor) -> tuple[paddle.Tensor, paddle.Tensor]:
        freqs = positions.astype("float32").unsqueeze(-1) * self.inv_freq  # [T, D/2]
        emb = paddle.concat([freqs, freqs], axis=-1).unsqueeze(1)  # [T, 1, D]
        return paddle.cos(emb), paddle.sin(emb)

    @staticmethod
    def apply(x: paddle.Tensor, cos: paddle.Tensor, sin: paddle.Tensor) -> paddle.Tensor:
        """x: [T, heads, D] -> same shape, rotated."""
        half = x.shape[-1] // 2
        rotated = paddle.concat([-x[..., half:], x[..., :half]], axis=-1)
        return x * cos + rotated * sin
