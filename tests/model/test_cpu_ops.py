"""The CPU kernels of ops_ext/ that serving steps run: mtp_small_matmul and mtp_rms_norm."""

from __future__ import annotations

import os

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


@pytest.mark.parametrize("rows", [1, 3, 5])
def test_float16_panels_compute_the_float16_rounded_weight(rows):
    """Half the bytes, the same sums: the product equals float64 arithmetic on the weight as float16
    rounds it (to float32 precision), and the rounding is really there (it differs from float32's)."""
    gen = np.random.default_rng(rows)
    # NOTE: magnitudes over many decades, so subnormal and large float16 weights are read too
    weight_t = (gen.standard_normal((255, 64)) * 10.0 ** gen.uniform(-6, 3, (255, 64))).astype(np.float32)
    x = gen.standard_normal((rows, 255)).astype(np.float32)
    bias = gen.standard_normal(64).astype(np.float32)
    half = small_matmul.pack(paddle.to_tensor(weight_t), "float16")
    assert half is not None and half.dtype == paddle.float16
    got = small_matmul.matmul(paddle.to_tensor(x), half, paddle.to_tensor(bias)).numpy()
    rounded = weight_t.astype(np.float16).astype(np.float64)
    want = x.astype(np.float64) @ rounded + bias
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3)
    whole = small_matmul.pack(paddle.to_tensor(weight_t))
    assert whole is not None
    full = small_matmul.matmul(paddle.to_tensor(x), whole).numpy() + bias
    assert not np.allclose(got, full, rtol=1e-6, atol=0)
    for r in range(rows):  # NOTE: row independence holds for float16 panels too
        alone = small_matmul.matmul(paddle.to_tensor(x[r:r + 1]), half, paddle.to_tensor(bias)).numpy()
        assert np.array_equal(alone[0], got[r])


def test_panels_in_another_dtype_are_refused():
    with pytest.raises(ValueError, match="float32 or float16"):
        small_matmul.pack(paddle.zeros([64, 32]), "bfloat16")


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
    # NOTE: ops_ext/worker_pool.cc sizes its pool once per process (MTP_CPU_THREADS, the affinity mask),
    # so each count needs its own process; panels are whole per thread, so the bits must not change.
    import subprocess
    import sys

    def run(count: str) -> bytes:
        env = {**os.environ, "MTP_CPU_THREADS": count}
        return subprocess.run([sys.executable, "-c", _PRODUCT], env=env, check=True, capture_output=True).stdout

    one = run("1")
    assert len(one) == 5 * 1536 * 4
    assert run(threads) == one


def test_a_kernel_lets_other_python_threads_run():
    # NOTE: a rank's event loop thread runs beside its device thread; a custom op that kept the GIL would
    # stall the loop for every kernel. Paddle's custom-op entry releases it around the kernel, and the
    # kernels rely on that (they touch no Python object). Here the main thread counts while another
    # thread is inside ~5 ms products: with the GIL held it could not count at all.
    import sys
    import threading

    gen = np.random.default_rng(5)
    panels = small_matmul.pack(paddle.to_tensor(gen.standard_normal((1024, 4096)).astype(np.float32)))
    assert panels is not None
    x = paddle.to_tensor(gen.standard_normal((64, 1024)).astype(np.float32))
    entered, done = threading.Event(), threading.Event()

    def work():
        entered.set()
        for _ in range(3):
            small_matmul.matmul(x, panels)
        done.set()

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)  # NOTE: hand the GIL over quickly, so only a held GIL can stop the count
    try:
        thread = threading.Thread(target=work)
        thread.start()
        entered.wait()
        count = 0
        while not done.is_set():
            count += 1
        thread.join()
    finally:
        sys.setswitchinterval(old)
    assert count > 10_000


_THREADS = """
import os
import numpy as np, paddle
from mtpserve.model import small_matmul
panels = small_matmul.pack(paddle.to_tensor(np.ones((256, 1536), np.float32)))
x = paddle.to_tensor(np.ones((3, 256), np.float32))
before = len(os.listdir("/proc/self/task"))
small_matmul.matmul(x, panels)  # NOTE: the first product large enough to split starts the workers
print(len(os.listdir("/proc/self/task")) - before)
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one CPU: no workers to start")
def test_the_kernels_use_every_cpu_of_the_process_by_default():
    # NOTE: importing Paddle sets OMP_NUM_THREADS=1 when it is unset; a pool sized by it silently ran on
    # one core. The workers follow the affinity mask, and MTP_CPU_THREADS caps them.
    import subprocess
    import sys

    def workers(extra: dict) -> int:
        env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MTP_CPU_THREADS")}
        done = subprocess.run([sys.executable, "-c", _THREADS], env={**env, **extra}, check=True,
                              capture_output=True, text=True)
        return int(done.stdout.split()[-1])

    assert workers({}) == len(os.sched_getaffinity(0)) - 1
    assert workers({"MTP_CPU_THREADS": "1"}) == 0
