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


PANEL_DTYPES = ("float32", "float16")


def pack(weight_t: paddle.Tensor, dtype: str = "float32") -> paddle.Tensor | None:
    """[K, N] (in, out) -> [N/32, K, 32] panels in `dtype`, or None where the op cannot serve this weight.

    float16 panels halve the bytes a product reads (the op widens them exactly as it reads), at the price
    of rounding the weight once: for weights whose products only guide a guess (model/mimo_model.py's
    draft weights), never for those that decide the output."""
    if dtype not in PANEL_DTYPES:
        raise ValueError(f"panels are float32 or float16, not {dtype!r}")
    k, n = weight_t.shape
    if n % PANEL or not weight_t.place.is_cpu_place() or weight_t.dtype != paddle.float32 or not available():
        return None
    with paddle.no_grad():
        panels = weight_t.reshape([k, n // PANEL, PANEL]).transpose([1, 0, 2]).contiguous()
        return panels if dtype == "float32" else panels.astype(dtype)


def matmul(x: paddle.Tensor, panels: paddle.Tensor, bias: paddle.Tensor | None = None) -> paddle.Tensor:
    """x [M, K] @ the packed weight (+ bias [N]) -> [M, N]. Only after `available()` (it registers the op)."""
    # NOTE: straight to Paddle's custom-op entry: this runs ~30 times per step, and mtpserve.ops.run_op's
    # name check and frame would be a tenth of a small product's time.
    # NOTE: _run_custom_op, Paddle's custom-op entry, is missing from Paddle's stubs.
    return _C_ops._run_custom_op("mtp_small_matmul", x, panels, bias)[0]  # pyright: ignore[reportAttributeAccessIssue]
