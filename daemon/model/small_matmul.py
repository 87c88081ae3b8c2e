"""Few-row products on CPU hosts: the `mtp_small_matmul` op (ops_ext/small_matmul.cc) and its weights.

A serving weight `[K, N]` is also kept as column panels `[N/32, K, 32]` (a second copy: the memory is
the price of reading each weight byte once per step). Steps of `MIN_ROWS` to `MAX_ROWS` rows (verify
passes and drafting at small batch) use the op; one row and larger steps (prefill, large batches) stay
on Paddle's matmul, which is faster there. GPU hosts never pack: their matmul has no such gap.
"""

from __future__ import annotations

import paddle
from paddle import _C_ops

from mtpserve.ops import cpu_op_available

PANEL = 32
# NOTE: measured on a 2-core AMD EPYC host cycling through 16 weights ([M, 256] x [256, 1536]): the op
# takes 121/121/122/164/169/200 us for 1/2/3/4/6/8 rows against MKL's 68/214/228/233/242/201. One row is
# MKL's GEMV at its best; from 8 rows MKL's GEMM amortises its packing.
MIN_ROWS, MAX_ROWS = 2, 6


def available() -> bool:
    """The op is built into this install and Paddle runs on the CPU."""
    return cpu_op_available("mtp_small_matmul")


def pack(weight_t: paddle.Tensor) -> paddle.Tensor | None:
    """[K, N] (in, out) -> [N/32, K, 32] panels, or None where the op cannot serve this weight."""
    k, n = weight_t.shape
    if n % PANEL or not weight_t.place.is_cpu_place() or weight_t.dtype != paddle.float32 or not available():
        return None
    with paddle.no_grad():
        return weight_t.reshape([k, n // PANEL, PANEL]).transpose([1, 0, 2]).contiguous()


def matmul(x: paddle.Tensor, panels: paddle.Tensor, bias: paddle.Tensor | None = None) -> paddle.Tensor:
    """x [M, K] @ the packed weight (+ bias [N]) -> [M, N]. Only after `available()` (it registers the op)."""
    # NOTE: straight to Paddle's custom-op entry: this runs ~30 times per step, and mtpserve.ops.run_op's
    # name check and frame would be a tenth of a small product's time.
    # NOTE: _run_custom_op, Paddle's custom-op entry, is missing from Paddle's stubs.
    return _C_ops._run_custom_op("mtp_small_matmul", x, panels, bias)[0]  # pyright: ignore[reportAttributeAccessIssue]
