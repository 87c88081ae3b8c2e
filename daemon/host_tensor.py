"""Tensors from NumPy arrays on the rank's hot path, without Paddle's per-construction leak.

NOTE: in Paddle 3.3's eager mode every Tensor constructed from Python (`paddle.to_tensor`,
`paddle.Tensor(...)`, `paddle.from_dlpack`) leaks one list: the constructor's keyword names, never
freed. A rank builds a dozen such tensors a step, so rank RSS grew ~20 MB a minute under steady load
(found by `mtpserve bench soak`; `tests/engine/test_host_tensor.py` pins both the leak and this way round it).
A tensor made by an op (`paddle.empty`) and filled from the array's memory costs the same and leaks
nothing.
"""

from __future__ import annotations

import ctypes

import numpy as np
import paddle
from paddle import _C_ops


def host_tensor(array: np.ndarray) -> paddle.Tensor:
    """A tensor holding a copy of `array`, on the place `paddle.to_tensor` would use (same shape, 0-d
    included, and same dtype)."""
    array = np.asarray(array, order="C")
    dtype = _PADDLE_DTYPE.get(array.dtype)
    if dtype is None:  # NOTE: a dtype the table lacks: Paddle's own conversion, on the slower path
        tensor = paddle.empty(list(array.shape), dtype=array.dtype)
    elif _CPU_ONLY:
        # NOTE: the op itself: paddle.empty's Python wrapper (argument decorators, dtype and place
        # conversion) costs 3.5 of its 4.8 us, and a step builds ~20 of these between its two threads.
        tensor = _C_ops.empty(list(array.shape), dtype, _CPU)
    else:
        tensor = paddle.empty(list(array.shape), dtype=dtype)
    # NOTE: Tensor.set_value does the same with more checks; the dense tensor's set is one copy.
    tensor.get_tensor().set(array, _CPU if _CPU_ONLY else _concrete(tensor.place))
    return tensor


# NOTE: a CPU-only build puts every tensor on the CPU; asking each tensor for its place costs more than
# the copy of a step's small index arrays.
_CPU_ONLY = not paddle.device.is_compiled_with_cuda()
_CPU = paddle.CPUPlace()
# NOTE: Paddle's own NumPy-dtype conversion goes through the dtype's name string on every call
_PADDLE_DTYPE = {np.dtype(name): getattr(paddle, name)
                 for name in ("float32", "float64", "int32", "int64", "bool", "uint8", "int8", "float16")}


def _concrete(place: paddle.base.core.Place) -> paddle.CPUPlace | paddle.CUDAPlace:
    """The typed place a dense tensor's `set` takes, for the generic one a tensor reports."""
    return paddle.CUDAPlace(place.gpu_device_id()) if place.is_gpu_place() else paddle.CPUPlace()


class StagedTensors:
    """Host tensors reused from step to step, one per (name, shape, dtype): staging an array writes it
    into the tensor its name had at that shape last time, through a NumPy view of the tensor's memory.

    NOTE: `host_tensor` is a Paddle call, and on a rank's device thread it runs just after a step's
    weights flushed the caches, then waits for the GIL behind the host loop: ~50 us a tensor in a batch-1
    step, against ~0.2 us for the copy. A staged tensor is overwritten when its name is staged again at
    the same shape, so stage only what nothing reads after the next staging of that name (a step's
    index arrays, a frame's columns), and keep each instance to one thread. CPU-only builds stage;
    elsewhere every call is `host_tensor` (a device tensor has no NumPy view).
    """

    def __init__(self, shapes_per_name: int = 8) -> None:
        self._shapes_per_name = shapes_per_name
        # NOTE: name -> {(shape, dtype): (tensor, view)}, oldest first; bounded per name
        self._staged: dict[str, dict[tuple, tuple[paddle.Tensor, np.ndarray]]] = {}

    def stage(self, name: str, array: np.ndarray) -> paddle.Tensor:
        array = np.asarray(array)
        if not _CPU_ONLY or array.dtype not in _PADDLE_DTYPE:
            return host_tensor(array)
        shapes = self._staged.setdefault(name, {})
        key = (array.shape, array.dtype)
        entry = shapes.get(key)
        if entry is None:
            if len(shapes) >= self._shapes_per_name:
                del shapes[next(iter(shapes))]
            tensor = host_tensor(array)
            entry = shapes[key] = (tensor, _view(tensor, array))
        else:
            entry[1][...] = array
        return entry[0]


def _view(tensor: paddle.Tensor, like: np.ndarray) -> np.ndarray:
    """A NumPy array over a CPU tensor's own memory (shape and dtype of `like`)."""
    if like.nbytes == 0:
        return np.empty(like.shape, like.dtype)
    buffer = (ctypes.c_byte * like.nbytes).from_address(tensor.data_ptr())
    return np.frombuffer(memoryview(buffer), dtype=like.dtype).reshape(like.shape)
