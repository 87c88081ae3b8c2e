"""host_tensor: the same tensor paddle.to_tensor makes, without the list Paddle leaks per construction;
and an engine running many steps with the real model keeps no Python objects it does not need; staged tensors
(reused per name and shape) hold the latest array."""

import collections
import gc

import numpy as np
import paddle
import pytest

from mtpserve.engine.request import EngineRequest, SamplingParams
from mtpserve.host_tensor import StagedTensors, host_tensor
from test_model_runner import make_core, prompts, tiny_model


def live_objects() -> collections.Counter:
    gc.collect()
    return collections.Counter(type(o).__qualname__ for o in gc.get_objects())


@pytest.mark.parametrize("array", [
    np.arange(7, dtype=np.int64), np.zeros((0, 3), np.int32), np.array([True, False]),
    np.float32(2.5) * np.ones((), np.float32), np.arange(24, dtype=np.float32).reshape(4, 6)[:, ::2],
], ids=["int64", "empty-int32", "bool", "0-d", "strided"])
def test_host_tensor_equals_to_tensor(array):
    ours, theirs = host_tensor(array), paddle.to_tensor(array)
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape and ours.place == theirs.place
    assert ours.stop_gradient
    np.testing.assert_array_equal(ours.numpy(), array)


def test_host_tensor_copies():
    array = np.arange(4, dtype=np.int64)
    tensor = host_tensor(array)
    array[0] = 99
    assert int(tensor.numpy()[0]) == 0


def test_paddle_to_tensor_still_leaks_and_host_tensor_does_not():
    """When this fails on its first assertion, Paddle fixed the leak and host_tensor can go."""
    array = np.arange(8, dtype=np.int64)
    before = live_objects()["list"]
    for _ in range(500):
        paddle.to_tensor(array)
    leaked_by_paddle = live_objects()["list"] - before
    before = live_objects()["list"]
    for _ in range(500):
        host_tensor(array)
    assert leaked_by_paddle >= 500
    assert live_objects()["list"] - before < 10


def serve(core, requests, batch=8):
    pending = list(requests)
    while pending or core.has_unfinished_requests():
        while pending and core.scheduler.num_unfinished < batch:
            core.add_request(pending.pop(0))
        core.step()


def mixed_load(tag: str) -> list[EngineRequest]:
    """Greedy and seeded sampled requests, half of them with top-3 logprobs."""
    texts = prompts(12, seed=3)
    return [EngineRequest(f"{tag}{i}", p, SamplingParams(
        temperature=0.0 if i % 3 else 0.8, seed=i, max_tokens=20, logprobs=3 if i % 2 else None))
        for i, p in enumerate(texts)]


def test_engine_steps_keep_no_objects():
    """Rounds of the same load (prefill, decode, verify at k = 2, sampling, logprobs) leave the live
    Python objects where the first round left them: a leak of even one object a step shows here."""
    core = make_core(tiny_model(), k=2)
    serve(core, mixed_load("warm"))
    before = live_objects()
    for round_ in range(3):
        serve(core, mixed_load(f"r{round_}-"))
    after = live_objects()
    core.close()
    grown = {name: n - before[name] for name, n in after.items() if n - before[name] > 20}
    assert grown == {}


@pytest.mark.skipif(paddle.device.is_compiled_with_cuda(), reason="staging writes CPU tensors through NumPy views")
def test_staged_tensors_are_reused_per_name_and_shape_and_hold_the_latest_array():
    staged = StagedTensors(shapes_per_name=2)
    first = staged.stage("ids", np.array([1, 2, 3], np.int64))
    again = staged.stage("ids", np.array([7, 8, 9], np.int64))
    assert again is first
    np.testing.assert_array_equal(first.numpy(), [7, 8, 9])
    # NOTE: a Paddle op reads the staged values, not the first ones
    table = paddle.arange(20, dtype="int64") * 10
    np.testing.assert_array_equal(paddle.gather(table, again).numpy(), [70, 80, 90])
    other_name = staged.stage("rows", np.array([7, 8, 9], np.int64))
    other_dtype = staged.stage("ids", np.array([7, 8, 9], np.int32))
    assert other_name is not first and other_dtype is not first and other_dtype.dtype == paddle.int32
    # NOTE: a third shape of one name evicts its oldest: the next [3] int64 is a new tensor
    wide = staged.stage("ids", np.zeros((2, 4), np.int64))
    assert wide.shape == [2, 4]
    assert staged.stage("ids", np.array([4, 5, 6], np.int64)) is not first
    np.testing.assert_array_equal(first.numpy(), [7, 8, 9])  # NOTE: an evicted tensor keeps its values
    empty = staged.stage("ids", np.zeros(0, np.int64))
    assert empty.shape == [0]


def test_staging_a_dtype_without_a_view_gives_a_new_tensor_each_time():
    staged = StagedTensors()
    values = np.array([1, 2], np.uint16)
    a, b = staged.stage("x", values), staged.stage("x", values)
    assert a is not b
    np.testing.assert_array_equal(a.numpy(), values)
