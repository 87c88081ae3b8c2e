"""A fake engine process for the HTTP process's end-to-end tests, before the real engine exists.

It speaks the real request channel (ipc/request_channel.py) and writes real wire frames on the
instance's real POSIX queue (fake_frames.py); the channel itself is created by the test, as the
supervisor would. Generation is deterministic and checkable: output token i of a request is
prompt[i % len(prompt)]; the first step emits one token (prefill), later steps 1..k+1 tokens (a
fixed pattern standing in for MTP acceptance); logprobs are a function of the token id, with a
descending top-k whose first entry is the sampled token. KV blocks are accounted per request, so
tests can watch them return to idle after aborts. A prefix cache stands in for the real one: the full
prompt blocks of every request that ran a step are cached, a later prompt hits its longest cached run
of full blocks short of its last token (PrefixHits at admission), ResetPrefixCache forgets them all.

Usage: python fake_engine.py RUNTIME_DIR INSTANCE [--vocab-size V] [--max-model-len L] [--k K] [--step-ms MS]
"""

from __future__ import annotations

import argparse
import asyncio
import math
from dataclasses import dataclass, field
from pathlib import Path

import uvloop

from mtpserve.ipc.request_channel import (
    AbortRequest, AddRequest, EngineReady, EngineStats, PrefixCacheReset, PrefixHits, RequestChannelServer,
    ResetPrefixCache, SamplingParams,
)
from mtpserve.lifecycle import die_with_parent
from fake_frames import FrameSink, OutputRow

BLOCK_SIZE = 16
NUM_BLOCKS = 4096


def fake_logprob(token_id: int) -> float:
    return -0.05 * (1 + token_id % 11)


def fake_top(token_id: int, width: int, vocab_size: int) -> tuple[list[int], list[float]]:
    """Sampled token first, then its successors with strictly lower logprobs."""
    ids = [(token_id + j) % vocab_size for j in range(width)]
    return ids, [fake_logprob(token_id) - 0.5 * j for j in range(width)]


@dataclass
class FakeRequest:
    add: AddRequest
    generated: list[int] = field(default_factory=list)
    steps: int = 0

    @property
    def params(self) -> SamplingParams:
        return self.add.sampling

    def num_blocks(self) -> int:
        return math.ceil((len(self.add.prompt_token_ids) + len(self.generated)) / BLOCK_SIZE)


class FakePrefixCache:
    """Cached blocks keyed by the prompt tokens up to each block's end (the hash chain, spelled out)."""

    def __init__(self) -> None:
        self.blocks: set[tuple[int, ...]] = set()
        self.queries = self.hits = 0  # prompt tokens looked up / found, as EngineStats counts them

    def match(self, prompt: list[int]) -> int:
        """The prompt's cached tokens at admission; the last prompt token is always computed."""
        cached = 0
        while cached + BLOCK_SIZE < len(prompt) and tuple(prompt[:cached + BLOCK_SIZE]) in self.blocks:
            cached += BLOCK_SIZE
        self.queries += len(prompt)
        self.hits += cached
        return cached

    def store(self, prompt: list[int]) -> None:
        self.blocks.update(_full_blocks(prompt))

    def num_evictable(self, running: list[FakeRequest]) -> int:
        held = {block for req in running for block in _full_blocks(req.add.prompt_token_ids)}
        return len(self.blocks - held)

    def reset(self) -> int:
        num_blocks = len(self.blocks)
        self.blocks.clear()
        return num_blocks


def _full_blocks(prompt: list[int]) -> list[tuple[int, ...]]:
    return [tuple(prompt[:end]) for end in range(BLOCK_SIZE, len(prompt) + 1, BLOCK_SIZE)]


class FakeEngine:
    def __init__(self, server: RequestChannelServer, sink: FrameSink, args: argparse.Namespace) -> None:
        self.server, self.sink, self.args = server, sink, args
        self.running: dict[int, FakeRequest] = {}
        self.step_id = 0
        self.num_drafts = self.num_draft_tokens = self.num_accepted = 0
        # NOTE: stand-ins with known values for counters only a real scheduler has: one preemption
        # per abort, and one discarded row per finished request.
        self.num_aborted = self.num_finished = 0
        self.accepted_per_pos = [0] * args.k
        self.prefix_cache = FakePrefixCache()

    async def run(self) -> None:
        last_stats = 0.0
        loop = asyncio.get_running_loop()
        while True:
            self.intake()
            if self.running:
                width = max(r.params.logprobs or 0 for r in self.running.values())
                await self.sink.send(self.step(), self.step_id, width)
            if loop.time() - last_stats > 0.05:
                self.server.send(self.stats())
                last_stats = loop.time()
            await asyncio.sleep(self.args.step_ms / 1000 if self.running else 0.005)

    def intake(self) -> None:
        hits: list[tuple[int, int]] = []  # (request id, cached prompt tokens)
        for msg in self.server.poll():
            if isinstance(msg, AddRequest):
                self.running[msg.request_id] = FakeRequest(msg)
                hits.append((msg.request_id, self.prefix_cache.match(msg.prompt_token_ids)))
            elif isinstance(msg, AbortRequest):
                for rid in msg.request_ids:
                    self.num_aborted += self.running.pop(rid, None) is not None
            elif isinstance(msg, ResetPrefixCache):
                self.reset_prefix_cache(msg)
        hits = [(rid, n) for rid, n in hits if n]
        if hits:  # NOTE: before the requests' first frames, as the rank loop sends them
            self.server.send(PrefixHits([rid for rid, _ in hits], [n for _, n in hits]))

    def reset_prefix_cache(self, msg: ResetPrefixCache) -> None:
        self.server.send(PrefixCacheReset(msg.token, self.prefix_cache.reset()))

    def step(self) -> list[OutputRow]:
        self.step_id += 1
        records = [self._advance(req) for req in self.running.values()]
        for record in records:
            if record.finish_reason is not None:
                del self.running[record.request_id]
                self.num_finished += 1
        return records

    def _advance(self, req: FakeRequest) -> OutputRow:
        want = 1 if req.steps == 0 else 1 + (req.add.request_id + req.steps) % (self.args.k + 1)
        is_decode = req.steps > 0
        if not is_decode:
            self.prefix_cache.store(req.add.prompt_token_ids)  # NOTE: cached once its prefill ran
        req.steps += 1
        prompt, params = req.add.prompt_token_ids, req.params
        new, finish = [], None
        while len(new) < want and finish is None:
            token = prompt[(len(req.generated) + len(new)) % len(prompt)]
            new.append(token)
            finish = self._finish_reason(req, token, len(req.generated) + len(new))
        if is_decode and self.args.k:
            self._count_spec(len(new) - 1)  # NOTE: counts what was emitted (max_tokens may cut a step)
        row = OutputRow(req.add.request_id, len(req.generated), new, params.logprobs is not None, finish)
        req.generated += new
        return row

    def _finish_reason(self, req: FakeRequest, token: int, num_generated: int) -> str | None:
        params = req.params
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else {self.args.eos_id})
        if token in stop_ids and num_generated >= params.min_tokens:
            return "stop"
        if num_generated >= params.max_tokens:
            return "length"
        return None

    def _count_spec(self, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += self.args.k
        self.num_accepted += accepted
        for pos in range(accepted):
            self.accepted_per_pos[pos] += 1

    def stats(self) -> EngineStats:
        return EngineStats(step_id=self.step_id, num_running=len(self.running), num_waiting=0,
                           num_kv_blocks_used=sum(r.num_blocks() for r in self.running.values()),
                           num_kv_blocks_total=NUM_BLOCKS, num_drafts=self.num_drafts,
                           num_draft_tokens=self.num_draft_tokens, num_accepted_tokens=self.num_accepted,
                           num_accepted_per_pos=list(self.accepted_per_pos),
                           num_preemptions=self.num_aborted, num_discarded_rows=self.num_finished,
                           prefix_cache_queries=self.prefix_cache.queries,
                           prefix_cache_hits=self.prefix_cache.hits,
                           num_kv_blocks_cached=len(self.prefix_cache.blocks),
                           num_kv_blocks_evictable=self.prefix_cache.num_evictable(list(self.running.values())))


async def amain(args: argparse.Namespace) -> None:
    server = await RequestChannelServer.start(args.runtime_dir)
    sink = FrameSink(args.instance, args.vocab_size)
    engine = FakeEngine(server, sink, args)
    server.set_ready(EngineReady(model_name="fake", max_model_len=args.max_model_len, vocab_size=args.vocab_size,
                                 eos_token_ids=[args.eos_id], num_speculative_tokens=args.k,
                                 num_kv_blocks=NUM_BLOCKS, kv_block_size=BLOCK_SIZE,
                                 output_channel=args.instance))
    try:
        await engine.run()
    finally:
        sink.close()
        await server.close()


def main() -> None:
    die_with_parent()  # NOTE: a killed test run leaves no fake engine behind
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("runtime_dir", type=Path)
    parser.add_argument("instance", help="output channel instance name (created by the test)")
    parser.add_argument("--vocab-size", type=int, default=1200)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--eos-id", type=int, default=0)
    parser.add_argument("--k", type=int, default=2)
    parser.add_argument("--step-ms", type=float, default=5.0)
    uvloop.run(amain(parser.parse_args()))


if __name__ == "__main__":
    main()
