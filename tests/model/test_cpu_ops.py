"""The CPU kernels of ops_ext/ that serving steps run: mtp_small_matmul and mtp_rms_norm."""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from mtpserve.model import small_matmul
from mtpserve.model.norm import RMSNorm
from mtpserve.ops import cpu_op_available


def test_the_cpu_kernels_are_built():
    # NOTE: no skip when they are missing: a CPU install without them would quietly serve slower.
    assert cpu_op_available("mtp_small_matmul") and cpu_op_available("mtp_rms_norm")
    assert small_matmul.pack(paddle.zeros([8, 64])) is not None


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("k", [256, 255])
def test_small_matmul_matches_numpy(rows, k):
    gen = np.random.default_rng(rows * 1000 + k)
    weight_t = gen.standard_normal((k, 96)).astype(np.float32)  # [in, out]
    bias = gen.standard_normal(96).astype(np.float32)
    x = gen.standard_normal((rows, k)).astype(np.float32)
    panels = small_matmul.pack(paddle.to_tensor(weight_t))
    assert panels is not None, "the op serves this weight"
    assert panels.shape == [96 // small_matmul.PANEL, k, small_matmul.PANEL]
    got = small_matmul.matmul(paddle.to_tensor(x), panels, paddle.to_tensor(bias)).numpy()
    np.testing.assert_allclose(got, x @ weight_t + bias, rtol=1e-4, atol=1e-4)
    no_bias = small_matmul.matmul(paddle.to_tensor(x), panels).numpy()
    np.testing.assert_allclose(no_bias, x @ weight_t, rtol=1e-4, atol=1e-4)


def test_a_rows_result_does_not_depend_on_its_neighbours():
    gen = np.random.default_rng(7)
    panels = small_matmul.pack(paddle.to_tensor(gen.standard_normal((256, 512)).astype(np.float32)))
    assert panels is not None
    x = gen.standard_normal((4, 256)).astype(np.float32)
    together = small_matmul.matmul(paddle.to_tensor(x), panels).numpy()
    for r in range(4):
        alone = small_matmul.matmul(paddle.to_tensor(x[r:r + 1]), panels).numpy()
        assert np.array_equal(alone[0], together[r])  # bit for bit


def test_small_matmul_reads_a_strided_input():
    gen = np.random.default_rng(3)
    weight_t = gen.standard_normal((64, 32)).astype(np.float32)
    wide = paddle.to_tensor(gen.standard_normal((64, 3)).astype(np.float32))
    x = wide.t()  # [3, 64], possibly a strided view
    panels = small_matmul.pack(paddle.to_tensor(weight_t))
    assert panels is not None
    got = small_matmul.matmul(x, panels).numpy()
    np.testing.assert_allclose(got, x.numpy() @ weight_t, rtol=1e-4, atol=1e-4)


def test_widths_that_are_not_whole_panels_are_not_packed():
    assert small_matmul.pack(paddle.zeros([64, 40])) is None


def test_rms_norm_op_matches_the_training_formula():
    norm = RMSNorm(256, 1e-6)
    norm.weight.set_value(paddle.to_tensor(np.random.default_rng(1).standard_normal(256).astype(np.float32)))
    x = paddle.to_tensor(np.random.default_rng(2).standard_normal((2, 5, 256)).astype(np.float32) * 3)
    norm.train()  # the Paddle-ops formula (what training differentiates)
    expected = norm(x).numpy()
    norm.eval()  # the serving kernel
    np.testing.assert_allclose(norm(x).numpy(), expected, rtol=1e-5, atol=1e-5)


_PRODUCT = """
import sys
import numpy as np, paddle
from mtpserve.model import small_matmul
gen = np.random.default_rng(11)
panels = small_matmul.pack(paddle.to_tensor(gen.standard_normal((256, 1536)).astype(np.float32)))
x = paddle.to_tensor(gen.standard_normal((5, 256)).astype(np.float32))
sys.stdout.buffer.write(small_matmul.matmul(x, panels).numpy().tobytes())
"""


@pytest.mark.parametrize("threads", ["1", "2", "3"])
def test_a_product_split_over_worker_threads_is_bit_identical_to_one_thread(threads):
    # NOTE: ops_ext/worker_pool.cc sizes its pool once per process (OMP_NUM_THREADS, the affinity mask),
    # so each count needs its own process; panels are whole per thread, so the bits must not change.
    import os
    import subprocess
    import sys

    def run(count: str) -> bytes:
        env = {**os.environ, "OMP_NUM_THREADS": count}
        return subprocess.run([sys.executable, "-c", _PRODUCT], env=env, check=True, capture_output=True).stdout

    one = run("1")
    assert len(one) == 5 * 1536 * 4
    assert run(threads) == one
