"""RMSNorm as Qwen2 defines it: x / rms(x) * weight, computed in fp32."""

from __future__ import annotations

import paddle
from paddle import nn
from paddle.base import core
from paddle.incubate.nn.functional import fused_rms_norm

# WHY: Paddle's fused CPU kernel (RmsNormAvxKernel) is built with AVX-512 instructions whatever the
# host; on a CPU without avx512f (AMD EPYC before Zen 4) it dies of SIGILL. GPU builds use CUDA.
_FUSED_OK = paddle.is_compiled_with_cuda() or core.supports_avx512f()


class RMSNorm(nn.Layer):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = self.create_parameter(shape=[hidden_size], dtype="float32",
                                            default_initializer=nn.initializer.Constant(1.0))
        self.shard_axes = {"weight": None}

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        if _FUSED_OK and x.dtype == paddle.float32 and not self.training:
            # NOTE: one kernel instead of six; at serving sizes on CPU the dispatch is the cost.
            return fused_rms_norm(x, self.weight, None, self.eps, begin_norm_axis=x.ndim - 1)[0]
        x32 = x if x.dtype == paddle.float32 else x.astype("float32")
        normed = x32 * paddle.rsqrt((x32 * x32).mean(axis=-1, keepdim=True) + self.eps)
        return (normed if normed.dtype == x.dtype else normed.astype(x.dtype)) * self.weight
