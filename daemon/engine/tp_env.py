"""Where the ranks are and how they meet: the environment Paddle's collective runtime reads.

The launcher of each host starts that host's ranks itself (no `paddle.distributed.launch`, which would
be a second supervisor): with N = tensor_parallel_size ranks over `nnodes` hosts, host `node_rank`
runs ranks node_rank*N/nnodes .. (node_rank+1)*N/nnodes - 1. All ranks rendezvous at rank 0's TCP
store, `master_addr:master_port`; nothing assumes the ranks share a host. Collectives use gloo on a
CPU host and NCCL when Paddle is built with CUDA.
"""

from __future__ import annotations

import os

from mtpserve.config import ParallelConfig


def local_ranks(parallel: ParallelConfig) -> range:
    per_node = parallel.tensor_parallel_size // parallel.nnodes
    return range(parallel.node_rank * per_node, (parallel.node_rank + 1) * per_node)


PLAN_ENDPOINT_VAR = "MTPSERVE_PLAN_ENDPOINT"
# NOTE: read by ops_ext/worker_pool.cc; outside MTPSERVE_*, which the configuration owns
CPU_THREADS_VAR = "MTP_CPU_THREADS"


def rank_environment(parallel: ParallelConfig, rank: int, cpu_count: int | None = None) -> dict[str, str]:
    """Variables for rank `rank`'s process (added to the launcher's own environment)."""
    size, master = parallel.tensor_parallel_size, f"{parallel.master_addr}:{parallel.master_port}"
    local = local_ranks(parallel)
    env = {
        "PADDLE_TRAINER_ID": str(rank), "PADDLE_TRAINERS_NUM": str(size),
        "PADDLE_LOCAL_RANK": str(rank - local.start), "PADDLE_LOCAL_SIZE": str(len(local)),
        "PADDLE_MASTER": master, "MASTER_ADDR": parallel.master_addr, "MASTER_PORT": str(parallel.master_port),
        # NOTE: the dynamic-graph process group only uses the first endpoint (the TCP store); the
        # others are placeholders Paddle's ParallelEnv insists on reading.
        "PADDLE_TRAINER_ENDPOINTS": ",".join([master] + [f"{parallel.master_addr}:{parallel.master_port + r}"
                                                         for r in range(1, size)]),
        "PADDLE_CURRENT_ENDPOINT": f"{parallel.master_addr}:{parallel.master_port + rank}",
        "FLAGS_selected_gpus": str(rank - local.start),
        # NOTE: rank 0 serves step plans on a socket of its own, above the ports of the rendezvous.
        PLAN_ENDPOINT_VAR: f"{parallel.master_addr}:{parallel.master_port + size}",
    }
    share = str(max(1, (cpu_count or len(os.sched_getaffinity(0)) or 1) // len(local)))
    # NOTE: ranks sharing a host split its cores instead of each spawning a thread per core: Paddle's
    # OpenMP kernels read OMP_NUM_THREADS, our CPU kernels' workers CPU_THREADS_VAR (ops_ext/worker_pool.h).
    for var in ("OMP_NUM_THREADS", CPU_THREADS_VAR):
        if size > 1 and var not in os.environ:
            env[var] = share
    return env


def cpu_threads_environment(parallel: ParallelConfig) -> dict[str, str]:
    """`parallel.cpu_threads` for every rank's CPU kernels, when it is set (it overrides the split of
    `rank_environment`; unset, a lone rank takes every CPU of its affinity mask)."""
    return {CPU_THREADS_VAR: str(parallel.cpu_threads)} if parallel.cpu_threads > 0 else {}
