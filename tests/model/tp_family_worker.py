"""One tensor-parallel rank of an engine on any model family: rank 0 samples `n` seeded requests of 4
tokens (temperature 0.3, top-k 50) with k = 2 fixed drafts and saves the tokens and its acceptance;
rank 1 follows rank 0's step plans. Started twice by test_family_tensor_parallel.py.

argv: model_dir out_dir n --rank R   (the launcher's rendezvous environment set by the test)
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

PROMPT = (5, 17, 42, 99, 3, 150, 64)


def run_rank(model_dir: Path, out_dir: Path, n: int, rank: int) -> None:
    from mtpserve.config import EngineConfig, SpeculativeConfig
    from mtpserve.engine.request import EngineRequest, SamplingParams
    from mtpserve.engine.tp_factory import build_follower_runner, build_leader_engine
    from mtpserve.engine.tp_group import join_group
    from mtpserve.engine.tp_plan_channel import PlanChannel
    from mtpserve.model.loader import load_serving_model

    tp = join_group(rank, 2)
    model = load_serving_model(model_dir, tp)
    sections = (EngineConfig(max_num_seqs=64, num_kv_blocks=1024, block_size=8),
                SpeculativeConfig(num_speculative_tokens=2, adaptive=False))
    if rank == 1:
        runner = build_follower_runner(model, PlanChannel(tp), *sections)
        runner.follow().result()
        runner.close()
        return
    core = build_leader_engine(model, PlanChannel(tp), *sections)
    pending = [EngineRequest(i, PROMPT, SamplingParams(temperature=0.3, top_k=50, seed=i, max_tokens=4,
                                                       ignore_eos=True)) for i in range(n)]
    outs: dict[int | str, list[int]] = {}
    while pending or core.has_unfinished_requests():
        while pending and core.scheduler.num_unfinished < 64:
            core.add_request(pending.pop(0))
        step = core.step()
        for i, rid in enumerate(step.request_ids):
            outs.setdefault(rid, []).extend(step.tokens_of(i).tolist())
    rates = core.acceptance.per_position_rate()
    core.close()  # sends the stop plan
    np.savez(out_dir / "tp2.npz", tokens=np.array([outs[i] for i in range(n)]), rates=np.array(rates))


if __name__ == "__main__":
    run_rank(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[5]))
