"""Two tensor-parallel ranks stay in lockstep: rank 1 runs exactly rank 0's step plans and decides
exactly the same tokens, drafts and logprobs (bitwise), greedy and sampled, without a token broadcast.

The test starts this file twice as a rank process (`python test_tp_ranks.py MODEL OUT --rank R`) with
the environment the launcher gives ranks; each rank saves every StepResult its runner produced.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))

from mtpserve.config import ParallelConfig  # noqa: E402
from mtpserve.engine.tp_env import rank_environment  # noqa: E402

REQUESTS = [  # (prompt, sampling parameters): greedy, sampled, penalised, logprobs, a long prefill
    ((5, 17, 33, 2), dict(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)),
    ((9, 1, 4), dict(temperature=1.0, seed=7, max_tokens=14, ignore_eos=True, logprobs=0)),
    ((40, 41, 42, 43, 44), dict(temperature=0.8, top_k=20, top_p=0.9, seed=3, max_tokens=10,
                                ignore_eos=True)),
    ((11,) * 30, dict(temperature=0.7, presence_penalty=0.5, repetition_penalty=1.2, seed=1,
                      max_tokens=9, ignore_eos=True)),
    (tuple(range(1, 70)), dict(temperature=0.0, max_tokens=8, ignore_eos=True)),
]
FIELDS = ("token_ids", "num_emitted", "num_accepted", "finish_reason", "is_valid")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ranks_decide_identically(tmp_path):
    from model_fixtures import make_model
    from mtpserve.model.checkpoint import save_checkpoint

    save_checkpoint(make_model(seed=5, vocab_size=98), tmp_path / "model")
    parallel = ParallelConfig(tensor_parallel_size=2, master_port=free_port())
    procs = [subprocess.Popen([sys.executable, __file__, str(tmp_path / "model"), str(tmp_path), "--rank", str(r)],
                              env={**os.environ, **rank_environment(parallel, r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
    outputs = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    leader, follower = (np.load(tmp_path / f"rank{r}.npz") for r in (0, 1))
    assert int(leader["num_steps"]) > 10 and int(leader["num_steps"]) == int(follower["num_steps"])
    assert leader["num_emitted"].sum() == sum(p["max_tokens"] for _, p in REQUESTS)
    assert leader["num_accepted"].sum() > 0  # the drafts were used, so they too had to agree
    for name in (*FIELDS, "token_logprobs", "top_logprobs"):
        np.testing.assert_array_equal(follower[name], leader[name], err_msg=name)


# ---- the rank process -----------------------------------------------------------------------------

def run_rank(model_dir: Path, out_dir: Path, rank: int) -> None:
    from mtpserve.config import EngineConfig, SpeculativeConfig
    from mtpserve.engine.request import EngineRequest, SamplingParams
    from mtpserve.engine.tp_factory import build_follower_runner, build_leader_engine
    from mtpserve.engine.tp_group import join_group
    from mtpserve.engine.tp_plan_channel import PlanChannel
    from mtpserve.model.loader import load_model

    tp = join_group(rank, 2)
    model, results = load_model(model_dir, tp), []
    sections = (EngineConfig(max_num_seqs=4, max_prefill_chunk=24, num_kv_blocks=64, block_size=4),
                SpeculativeConfig(num_speculative_tokens=2))
    if rank == 0:
        core = build_leader_engine(model, PlanChannel(tp), *sections, on_result=results.append)
        for i, (prompt, sampling) in enumerate(REQUESTS):
            core.add_request(EngineRequest(i, prompt, SamplingParams(**sampling)))
        while core.has_unfinished_requests():
            core.step()
        core.close()  # sends the stop plan
    else:
        runner = build_follower_runner(model, PlanChannel(tp), *sections, on_result=results.append)
        runner.follow().result()
        runner.close()
    # NOTE: numpy's stub checks **arrays against savez's `allow_pickle: bool` keyword.
    np.savez(out_dir / f"rank{rank}.npz", **stacked(results))  # pyright: ignore[reportArgumentType]


def _same_width(arrays: list[np.ndarray]) -> list[np.ndarray]:
    """Token columns padded with -1 to the widest step's (each step verifies as wide as its windows)."""
    if arrays[0].ndim < 2:
        return arrays
    width = max(a.shape[1] for a in arrays)
    return [np.pad(a, ((0, 0), (0, width - a.shape[1])), constant_values=-1) for a in arrays]


def stacked(results: list) -> dict[str, np.ndarray]:
    """Every step's results end to end (rows of all steps), and the emitted tokens' logprobs."""
    out = {name: np.concatenate(_same_width([getattr(r, name) for r in results])) for name in FIELDS}
    with_lp = [r.logprobs for r in results if r.logprobs is not None]
    out["token_logprobs"] = np.concatenate([lp.token_logprobs.ravel() for lp in with_lp])
    out["top_logprobs"] = np.concatenate([lp.top_logprobs.ravel() for lp in with_lp])
    out["num_steps"] = np.asarray(len(results))
    return out


if __name__ == "__main__":
    run_rank(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[4]))
