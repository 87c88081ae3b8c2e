"""Rotary position embedding in the Hugging Face "rotate half" layout that Qwen2 checkpoints use."""

from __future__ import annotations

import paddle


class RotaryEmbedding:
    """Applies RoPE at arbitrary positions, so prefill chunks, decode and verify share one code path.

    cos/sin are tabulated once for every position below `max_positions`; a step only gathers its rows
    (per-op dispatch, not arithmetic, is what a small model pays for on CPU).
    """

    def __init__(self, head_dim: int, theta: float, max_positions: int):
        exponents = paddle.arange(0, head_dim, 2, dtype="float32") / head_dim
        self.inv_freq = 1.0 / (theta ** exponents)  # [D/2]
        positions = paddle.arange(max_positions, dtype="float32")
        freqs = positions.unsqueeze(-1) * self.inv_freq  # [P, D/2]
        self.cos_table = paddle.cos(paddle.concat([freqs, freqs], axis=-1))  # [P, D]
        sin = paddle.sin(freqs)
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
