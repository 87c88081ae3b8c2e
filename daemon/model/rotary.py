"""Rotary position embedding in the Hugging Face "rotate half" layout that Qwen2 checkpoints use."""

from __future__ import annotations

import math

import numpy as np
import paddle

from mtpserve.model.deepseek_config import YarnScaling


class RotaryEmbedding:
    """Applies RoPE at arbitrary positions, so prefill chunks, decode and verify share one code path.

    cos/sin are tabulated once for every position below `max_positions`; a step only gathers its rows
    (per-op dispatch, not arithmetic, is what a small model pays for on CPU).
    """

    def __init__(self, head_dim: int, theta: float, max_positions: int, yarn: YarnScaling | None = None):
        exponents = paddle.arange(0, head_dim, 2, dtype="float32") / head_dim
        self.inv_freq = 1.0 / (theta ** exponents)  # [D/2]
        scale = 1.0
        if yarn is not None:
            self.inv_freq = paddle.to_tensor(yarn_inv_freq(head_dim, theta, yarn))
            scale = yarn.cos_sin_scale
        positions = paddle.arange(max_positions, dtype="float32")
        freqs = positions.unsqueeze(-1) * self.inv_freq  # [P, D/2]
        self.cos_table = paddle.cos(paddle.concat([freqs, freqs], axis=-1))  # [P, D]
        sin = paddle.sin(freqs)
        if scale != 1.0:
            self.cos_table, sin = self.cos_table * scale, sin * scale
        # NOTE: rotate_half(x) * sin == roll(x, D/2) * [-sin, sin]; the sign lives in the table.
        self.signed_sin_table = paddle.concat([-sin, sin], axis=-1)  # [P, D]
        self._last_positions: paddle.Tensor | None = None
        self._last_cos_sin: tuple[paddle.Tensor, paddle.Tensor] | None = None

    def cos_sin(self, positions: paddle.Tensor) -> tuple[paddle.Tensor, paddle.Tensor]:
        """positions: [T] -> cos, signed sin: [T, 1, D].

        NOTE: the result for the last `positions` tensor is kept: a serving step passes the same tensor
        to the main model and to every MTP depth, which then share one lookup. Positions tensors are
        never modified in place, so the same object means the same values.
        """
        if positions is not self._last_positions:
            cos = paddle.gather(self.cos_table, positions).unsqueeze(1)
            self._last_cos_sin = cos, paddle.gather(self.signed_sin_table, positions).unsqueeze(1)
            self._last_positions = positions
        assert self._last_cos_sin is not None
        return self._last_cos_sin

    @staticmethod
    def apply(x: paddle.Tensor, cos: paddle.Tensor, signed_sin: paddle.Tensor) -> paddle.Tensor:
        """x: [T, heads, D] -> same shape, rotated."""
        return x * cos + paddle.roll(x, x.shape[-1] // 2, axis=-1) * signed_sin


def yarn_inv_freq(dim: int, theta: float, yarn: YarnScaling) -> np.ndarray:
    """YaRN's frequencies [D/2] float32 (arXiv 2309.00071, as DeepSeek-V3 uses it): dimensions that
    turn more than beta_fast times over the original context keep their frequency, those that turn
    fewer than beta_slow times are divided by `factor`, and a linear ramp blends the ones between."""
    def correction_dim(rotations: float) -> float:
        return dim * math.log(yarn.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(yarn.beta_fast)), 0)
    high = min(math.ceil(correction_dim(yarn.beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # NOTE: the reference's guard against a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
    pos_freqs = (np.float32(theta) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))).astype(np.float32)
    extrapolation = (1.0 / pos_freqs).astype(np.float32)
    interpolation = (1.0 / (np.float32(yarn.factor) * pos_freqs)).astype(np.float32)
    keep = (1 - ramp).astype(np.float32)  # 1: the original frequency
    return (interpolation * (1 - keep) + extrapolation * keep).astype(np.float32)
