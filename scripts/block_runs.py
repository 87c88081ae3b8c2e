"""How the KV block manager lays out block tables once the pool has cycled: a scheduler replay over the
synthetic device (no model time), at 64 streams on a pool of 64-token blocks, for each k and workload.

    .venv/bin/python scripts/block_runs.py [--k 0 3] [--workloads distinct shared] [--blocks 1169] [--json OUT]

Prints, per (k, workload), the prefix-cache hit rate and the share of the running tables' neighbouring blocks
that are consecutive in the pool (sampled every step after a third of the requests finished), then the share
that is not, by the neighbour's position in its table. CPU attention reads a table's blocks in order, and
scattered blocks cost it 1.24-1.38x (`mtpserve bench attention --layouts`), so this is the figure behind
`BlockManager.take`'s rules (docs/architecture.md, "Runs of blocks").

Workloads: `distinct`, 256 random tokens per prompt; `shared`, one of 16 512-token prefixes (Zipf
popularity) and 64 random tokens. Outputs of 96-159 tokens, greedy, no stop. A K > 0 replay pins every
row's drafts to 0 unless MTP_DEPTH_SCHEDULE says otherwise (step_trace.DepthSchedule), as a K = 3 instance
at depth 0; its decode blocks are not cached, as a served one's.
"""

from __future__ import annotations

import argparse
import json
import os
from collections import Counter

import numpy as np

from mtpserve.engine.engine_core import CoreConfig, EngineCore
from mtpserve.engine.request import EngineRequest, SamplingParams
from mtpserve.engine.scheduler import SchedulerConfig
from mtpserve.engine.step_trace import SCHEDULE_ENV
from mtpserve.engine.synthetic_runner import SyntheticConfig, SyntheticRunner

BLOCK_SIZE, STREAMS, VOCAB = 64, 64, 4000


def replay(k: int, workload: str, num_blocks: int, num_requests: int, seed: int = 1) -> dict:
    sched = SchedulerConfig(max_num_seqs=STREAMS, num_speculative_tokens=k, num_blocks=num_blocks,
                            block_size=BLOCK_SIZE, enable_prefix_caching=True)
    runner = SyntheticRunner(SyntheticConfig(step_time_s=0.0, acceptance_rate=0.6, vocab_size=VOCAB,
                                             num_speculative_tokens=k, max_num_seqs=STREAMS,
                                             num_blocks=num_blocks, block_size=BLOCK_SIZE))
    core = EngineCore(CoreConfig(sched, overlap=True, eos_token_ids=(), adaptive_speculation=False), runner)
    gen = np.random.default_rng(seed)
    prefixes = [tuple(int(t) for t in gen.integers(1, VOCAB, 512)) for _ in range(16)]
    zipf = 1.0 / np.arange(1, 17)
    zipf /= zipf.sum()

    def prompt() -> tuple[int, ...]:
        tail = tuple(int(t) for t in gen.integers(1, VOCAB, 64 if workload == "shared" else 256))
        return prefixes[gen.choice(16, p=zipf)] + tail if workload == "shared" else tail

    sent = done = 0
    pairs, breaks = Counter(), Counter()
    while done < num_requests:
        while sent < num_requests and sent - done < STREAMS:
            params = SamplingParams(temperature=0.0, max_tokens=96 + (sent * 37) % 64, ignore_eos=True)
            core.add_request(EngineRequest(str(sent), prompt(), params))
            sent += 1
        done += int((core.step().finish_reasons != 0).sum())
        if done > num_requests // 3:
            for request in core.scheduler.running:
                table = request.block_ids
                for i in range(1, len(table)):
                    pairs[i] += 1
                    breaks[i] += table[i] != table[i - 1] + 1
    prefix = core.scheduler.prefix
    total = sum(pairs.values())
    return {"k": k, "workload": workload, "num_blocks": num_blocks, "requests": num_requests,
            "hit_rate": prefix.hits / max(prefix.queries, 1),
            "consecutive": 1.0 - sum(breaks.values()) / max(total, 1),
            "broken_by_position": {i: breaks[i] / pairs[i] for i in sorted(pairs)}}


def main() -> None:
    parser = argparse.ArgumentParser(description="a scheduler replay of the KV block layout (see the module's notes)")
    parser.add_argument("--k", type=int, nargs="+", default=[0, 3])
    parser.add_argument("--workloads", nargs="+", choices=("distinct", "shared"), default=["distinct", "shared"])
    parser.add_argument("--blocks", type=int, default=1169, help="pool size (a K=3 instance's default: 1,169)")
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    if SCHEDULE_ENV not in os.environ:
        os.environ[SCHEDULE_ENV] = "0x1"  # NOTE: read when each core is built: every row drafts nothing
    results = []
    for workload in args.workloads:
        for k in args.k:
            r = replay(k, workload, args.blocks, args.requests)
            results.append(r)
            positions = " ".join(f"{i}:{share:.2f}" for i, share in r["broken_by_position"].items())
            print(f"k={k} {workload:8s} hit rate {r['hit_rate']:.3f}  consecutive neighbours {r['consecutive']:.3f}"
                  f"  not consecutive by position {positions}", flush=True)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(results, out, indent=1)


if __name__ == "__main__":
    main()
