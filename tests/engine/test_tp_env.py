"""Which ranks a host starts and what each is told about the group."""

from __future__ import annotations

from mtpserve.config import ParallelConfig
from mtpserve.engine.tp_env import local_ranks, rank_environment


def test_each_host_starts_its_own_slice_of_ranks():
    hosts = [ParallelConfig(tensor_parallel_size=4, nnodes=2, node_rank=n, master_addr="10.0.0.1")
             for n in (0, 1)]
    assert [list(local_ranks(h)) for h in hosts] == [[0, 1], [2, 3]]


def test_every_rank_meets_at_rank_zeros_store():
    host = ParallelConfig(tensor_parallel_size=4, nnodes=2, node_rank=1, master_addr="10.0.0.1",
                          master_port=6000)
    envs = [rank_environment(host, r, cpu_count=8) for r in local_ranks(host)]
    assert [e["PADDLE_TRAINER_ID"] for e in envs] == ["2", "3"]
    assert [e["PADDLE_LOCAL_RANK"] for e in envs] == ["0", "1"]
    for env in envs:
        assert env["PADDLE_TRAINERS_NUM"] == "4"
        assert env["PADDLE_MASTER"] == "10.0.0.1:6000" == env["PADDLE_TRAINER_ENDPOINTS"].split(",")[0]
        assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("10.0.0.1", "6000")


def test_the_cpu_kernels_threads_are_configured_or_split_among_a_hosts_ranks(monkeypatch):
    from mtpserve.engine.tp_env import CPU_THREADS_VAR, cpu_threads_environment

    monkeypatch.delenv(CPU_THREADS_VAR, raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert cpu_threads_environment(ParallelConfig()) == {}  # NOTE: a lone rank takes its affinity mask
    assert cpu_threads_environment(ParallelConfig(cpu_threads=3)) == {CPU_THREADS_VAR: "3"}
    two = ParallelConfig(tensor_parallel_size=2)
    assert rank_environment(two, 0, cpu_count=8)[CPU_THREADS_VAR] == "4"
    assert rank_environment(two, 1, cpu_count=1)[CPU_THREADS_VAR] == "1"
