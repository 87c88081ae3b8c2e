"""Tensor parallelism: two ranks with sliced weights give the same logits as one rank, for every family
(MiMo; DeepSeek-V3: MLA heads split, the latent cache whole on each rank, experts split inside;
ERNIE-4.5 MoE: KV heads split, experts split inside)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import deepseek_fixtures
import ernie_fixtures
from model_fixtures import make_model
from mtpserve.model.checkpoint import save_checkpoint

WORKER = Path(__file__).resolve().parent / "tp_worker.py"


def write_family(family: str, directory: Path) -> int:
    """The family's tiny checkpoint in `directory`; returns its vocabulary size."""
    if family == "deepseek":
        deepseek_fixtures.write_checkpoint(directory)
        return deepseek_fixtures.TINY_V3["vocab_size"]
    if family == "ernie":
        ernie_fixtures.write_checkpoint(directory)
        return ernie_fixtures.TINY_ERNIE["vocab_size"]
    save_checkpoint(make_model(seed=11, vocab_size=98), directory)
    return 98


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_group(argv: list[str], env: dict, timeout: float) -> subprocess.CompletedProcess:
    """Run argv in its own process group; on timeout kill the whole group (the launcher's rank workers
    hold its pipes, so killing the launcher alone would leave `communicate` waiting forever)."""
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return subprocess.CompletedProcess(argv, -9, out, f"timed out after {timeout} s\n{err}")
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


@pytest.mark.parametrize("family", ["mimo", "deepseek", "ernie"])
def test_two_ranks_match_one_rank(tmp_path, family):
    vocab = write_family(family, tmp_path / "model")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    single = subprocess.run([sys.executable, str(WORKER), str(tmp_path / "model"), str(tmp_path / "tp1.npy")],
                            env=env, capture_output=True, text=True, timeout=120)
    assert single.returncode == 0, single.stderr[-2000:]
    # NOTE: its own job id and ports, so launches running side by side (another suite) never meet
    launch = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", "2",
              "--job_id", tmp_path.name, "--start_port", str(free_port()),
              "--log_dir", str(tmp_path / "logs"), str(WORKER), str(tmp_path / "model"), str(tmp_path / "tp2.npy")]
    double = run_group(launch, env, timeout=180)
    if double.returncode != 0:
        logs = "".join(p.read_text()[-1500:] for p in sorted((tmp_path / "logs").glob("*")) if p.is_file())
        pytest.fail(f"tp=2 launch failed: {double.stderr[-1500:]}\n{logs}")
    assert (tmp_path / "tp2.world").read_text() == "2"
    one, two = np.load(tmp_path / "tp1.npy"), np.load(tmp_path / "tp2.npy")
    assert one.shape == two.shape == (28, vocab)
    np.testing.assert_allclose(two, one, rtol=0, atol=1e-4 * np.abs(one).max())
