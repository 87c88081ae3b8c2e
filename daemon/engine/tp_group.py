"""Join the tensor-parallel group from the environment the launcher set (daemon/engine/tp_env.py)."""

from __future__ import annotations

import os

import paddle
import paddle.distributed as dist

from mtpserve.engine.tp_env import PLAN_ENDPOINT_VAR
from mtpserve.model.parallel import SINGLE, TensorParallel


def join_group(rank: int, size: int) -> TensorParallel:
    """Blocks until all `size` ranks reached rank 0's TCP store; SINGLE when size == 1."""
    if size == 1:
        return SINGLE
    # NOTE: with the default backend ("auto") a CPU-only Paddle takes its legacy static-graph path and
    # creates no process group; naming the backend gets the dynamic-graph gloo/NCCL group.
    os.environ.setdefault("PADDLE_DISTRI_BACKEND", backend())
    group = dist.init_parallel_env()
    if dist.get_rank() != rank or dist.get_world_size() != size:
        raise RuntimeError(f"collective runtime says rank {dist.get_rank()} of {dist.get_world_size()}, "
                           f"expected {rank} of {size}")
    return TensorParallel(rank=rank, size=size, group=group, plan_endpoint=os.environ[PLAN_ENDPOINT_VAR])


def backend() -> str:
    return "nccl" if paddle.device.is_compiled_with_cuda() else "gloo"
