"""Products with packed weights on CPU hosts: the `mtp_small_matmul` op (ops_ext/small_matmul.cc).

A serving weight `[K, N]` is also kept as column panels `[N/32, K, 32]` (a second copy: the memory is
the price of reading each weight byte once per step). Every serving product with a packed weight uses
the op, whatever its row count: it splits panels over the CPU kernels' worker threads
(ops_ext/worker_pool.h), while Paddle's matmul runs on one thread in a rank (importing Paddle sets
OMP_NUM_THREADS=1). GPU hosts never pack: their matmul has no such gap.
"""

from __future__ import annotations

import paddle
from paddle import _C_ops

from mtpserve.ops import cpu_op_available

PANEL = 32
# NOTE: measured on a 2-core AMD EPYC host (`[M, 256] x [256, 4096]`, warm): the op took 24/32/141/380/
# 999/6318 us for 1/3/16/48/128/512 rows against Paddle's matmul's 44/161/474/1331/2056/11201.


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
