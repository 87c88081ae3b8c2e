"""The compiled C++ ops (ops_ext/), registered with Paddle once per process.

setup.py builds ops_ext/*.cc into mtpserve/_ops*.so; this module registers that library with Paddle and
exposes each op as a typed Python function. Only rank processes import it (it imports paddle).
"""

from __future__ import annotations

import functools
from pathlib import Path

import paddle
from paddle import _C_ops
from paddle.utils.cpp_extension.extension_utils import load_op_meta_info_and_register_op


class OpsNotBuiltError(RuntimeError):
    """The shared library is missing: the package was installed without building ops_ext/."""


@functools.cache
def _registered_op_names() -> frozenset[str]:
    found = sorted(Path(__file__).parent.glob("_ops*.so"))
    if not found:
        raise OpsNotBuiltError("mtpserve/_ops*.so not found; run `make install` (or pip install -e .)")
    return frozenset(load_op_meta_info_and_register_op(str(found[0])))


def run_op(name: str, *args):
    """Run a registered custom op by name (inputs first, then attributes, in the op's order)."""
    if name not in _registered_op_names():
        raise KeyError(f"op {name!r} is not in the compiled library")
    return _C_ops._run_custom_op(name, *args)


def probe_count(x: paddle.Tensor) -> paddle.Tensor:
    return run_op("mtp_probe_count", x)
