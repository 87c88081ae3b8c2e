"""RMSNorm as Qwen2 defines it: x / rms(x) * weight, computed in fp32."""

from __future__ import annotations

import paddle
from paddle import nn


class RMSNorm(nn.Layer):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = self.create_parameter(shape=[hidden_size], dtype="float32",
                                            default_initializer=nn.initializer.Constant(1.0))
        self.shard_axes = {"weight": None}

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        x32 = x.astype("float32")
        variance = x32.pow(2).mean(axis=-1, keepdim=True)
        return (x32 * paddle.rsqrt(variance + self.eps)).astype(x.dtype) * self.weight
