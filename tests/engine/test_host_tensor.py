"""host_tensor: the same tensor paddle.to_tensor makes, without the list Paddle leaks per construction;
and an engine running many steps with the real model keeps no Python objects it does not need."""

import collections
import gc

import numpy as np
import paddle
import pytest

from mtpserve.engine.request import EngineRequest, SamplingParams
from mtpserve.host_tensor import host_tensor
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
