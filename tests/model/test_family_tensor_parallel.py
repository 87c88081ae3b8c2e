"""Speculative sampling at TP = 2 keeps the distribution, for DeepSeek-V3 and ERNIE-4.5 MoE: 1200 seeded
samples drawn by a two-rank engine with k = 2 (drafts accepted: the drafty checkpoints) follow the
distribution of plain sampling at TP = 1 (two-sample chi-square on tokens 2..4)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import deepseek_fixtures
import ernie_fixtures
import numpy as np
import pytest
from family_harness import sampled_tokens, two_sample_chi2_pvalue
from tp_family_worker import PROMPT

from mtpserve.config import ParallelConfig
from mtpserve.engine.tp_env import rank_environment
from mtpserve.model.loader import load_serving_model

WORKER = Path(__file__).resolve().parent / "tp_family_worker.py"
N = 1200
FAMILIES = {"deepseek": deepseek_fixtures, "ernie": ernie_fixtures}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_sampling_at_tp2_with_mtp_keeps_the_distribution(tmp_path, family):
    fixtures = FAMILIES[family]
    fixtures.write_checkpoint(tmp_path / "model", tensors=fixtures.drafty_tensors())
    parallel = ParallelConfig(tensor_parallel_size=2, master_port=free_port())
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(tmp_path / "model"), str(tmp_path), str(N),
                               "--rank", str(r)], env={**os.environ, **rank_environment(parallel, r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
    try:
        outputs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()  # NOTE: a no-op for a rank that exited; a hung one must not outlive the test
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    tp2 = np.load(tmp_path / "tp2.npz")
    assert tp2["rates"][0] > 0.3, tp2["rates"]  # drafts are really accepted, not only rejected
    plain, _ = sampled_tokens(load_serving_model(tmp_path / "model"), 0, list(PROMPT), N)
    vocab = int(max(plain.max(), tp2["tokens"].max())) + 1
    for col in (1, 2, 3):
        assert two_sample_chi2_pvalue(plain[:, col], tp2["tokens"][:, col], vocab) > 1e-4
    assert (plain != tp2["tokens"]).any()
