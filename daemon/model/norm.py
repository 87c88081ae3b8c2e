"""RMSNorm as Qwen2 defines it: x / rms(x) * weight, computed in fp32."""

from __future__ import annotations

import paddle
from paddle import _C_ops, nn
from paddle.incubate.nn.functional import fused_rms_norm

from mtpserve.ops import cpu_op_available


class RMSNorm(nn.Layer):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = self.create_parameter(shape=[hidden_size], dtype="float32",
                                            default_initializer=nn.initializer.Constant(1.0))
        self.shard_axes = {"weight": None}

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        # NOTE: serving uses one kernel instead of six; at serving sizes on CPU the dispatch is the cost.
        if x.dtype == paddle.float32 and not self.training:
            # NOTE: our kernel (ops_ext/rms_norm.cc), not Paddle's fused CPU one: that is built with
            # AVX-512 instructions whatever the host and dies of SIGILL on AMD EPYC before Zen 4.
            if cpu_op_available("mtp_rms_norm"):
                # NOTE: _run_custom_op, Paddle's custom-op entry, is missing from Paddle's stubs.
                out = _C_ops._run_custom_op(  # pyright: ignore[reportAttributeAccessIssue]
                    "mtp_rms_norm", x, self.weight, self.eps)
                return out[0]
            if paddle.device.is_compiled_with_cuda():
                return fused_rms_norm(x, self.weight, None, self.eps, begin_norm_axis=x.ndim - 1)[0]
        x32 = x if x.dtype == paddle.float32 else x.astype("float32")
        normed = x32 * paddle.rsqrt((x32 * x32).mean(axis=-1, keepdim=True) + self.eps)
        return (normed if normed.dtype == x.dtype else normed.astype(x.dtype)) * self.weight

