"""Scheduler policy, driven by a tiny host-side stand-in for the device: each emitting row yields
tokens that depend only on (prompt, output index), so recompute after preemption must reproduce them."""

import collections

import numpy as np
import pytest

from mtpserve.engine.request import EngineRequest, FinishReason, Request, SamplingParams
from mtpserve.engine.scheduler import Scheduler, SchedulerConfig


def make(rid, prompt_len, max_tokens=8, arrival=0):
    prompt = tuple(range(1, prompt_len + 1))
    return Request(EngineRequest(rid, prompt, SamplingParams(max_tokens=max_tokens)), arrival, seed=0)


def token_at(request, index):
    return int((request.prompt_ids.sum() * 31 + index * 7) % 1000)


def commit_plan(sched, plan, rng, k):
    for row in plan.rows:
        if not sched.is_current(row):
            continue
        req = row.request
        if not row.emits:
            sched.commit(row, [], FinishReason.NONE)
            continue
        n = 1 if row.is_prefill else int(rng.integers(1, k + 2))
        start = len(req.output_ids)
        n = min(n, req.params.max_tokens - start)
        tokens = [token_at(req, start + i) for i in range(n)]
        done = start + n >= req.params.max_tokens
        sched.commit(row, tokens, FinishReason.LENGTH if done else FinishReason.NONE)


def drive(sched, requests, *, depth=2, k=0, seed=0, max_steps=10_000):
    """Run to completion with `depth` plans in flight (2 = overlap); returns the number of steps."""
    rng = np.random.default_rng(seed)
    for r in requests:
        sched.add(r)
    inflight = collections.deque()
    steps = 0
    while sched.num_unfinished or inflight:
        plan = sched.schedule()
        if not plan.is_empty:
            inflight.append(plan)
        if inflight and (len(inflight) >= depth or plan.is_empty):
            commit_plan(sched, inflight.popleft(), rng, k)
        steps += 1
        assert steps < max_steps, "no progress"
    return steps


def test_fcfs_admission_bounded_by_max_num_seqs():
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, num_blocks=64, block_size=4))
    reqs = [make(f"r{i}", 5, arrival=i) for i in range(4)]
    for r in reqs:
        sched.add(r)
    plan = sched.schedule()
    assert [row.request.request_id for row in plan.rows] == ["r0", "r1"]
    assert [r.request_id for r in sched.waiting] == ["r2", "r3"]
    assert {row.slot for row in plan.rows} == {0, 1}


def test_chunked_prefill_only_last_chunk_emits():
    sched = Scheduler(SchedulerConfig(max_prefill_chunk=32, num_blocks=64, block_size=4))
    req = make("a", 100)
    sched.add(req)
    chunks = []
    for _ in range(4):
        plan = sched.schedule()
        (row,) = plan.rows
        chunks.append((row.start_pos, row.num_tokens, row.emits))
    assert chunks == [(0, 32, False), (32, 32, False), (64, 32, False), (96, 4, True)]


def test_token_budget_caps_a_step_and_admission_is_fcfs():
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=20, max_prefill_chunk=64,
                                      num_blocks=64, block_size=4))
    for i, n in enumerate([12, 30, 3]):
        sched.add(make(f"r{i}", n, arrival=i))
    plan = sched.schedule()
    assert [(row.request.request_id, row.num_tokens) for row in plan.rows] == [("r0", 12), ("r1", 8)]
    assert plan.num_tokens == 20


def _burst_after(decoder_tokens, cap):
    """A step's rows when six 16-token prompts arrive: after one request that is decoding (decoder_tokens
    > 0), or with nothing running."""
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_prefill_chunk=16, max_prefill_tokens_decoding=cap,
                                      num_blocks=256, block_size=4))
    if decoder_tokens:
        sched.add(make("d", decoder_tokens, max_tokens=50, arrival=0))
        commit_plan(sched, sched.schedule(), np.random.default_rng(0), 0)
    for i in range(6):
        sched.add(make(f"p{i}", 16, arrival=i + 1))
    plan = sched.schedule()
    return [(row.request.request_id, row.num_tokens, row.is_prefill) for row in plan.rows]


def test_while_a_request_decodes_a_step_carries_at_most_the_decoding_prompt_budget():
    assert _burst_after(4, cap=24) == [("d", 1, False), ("p0", 16, True), ("p1", 8, True)]


def test_with_nothing_decoding_or_no_cap_prompts_fill_the_whole_budget():
    assert [n for _, n, _ in _burst_after(0, cap=24)] == [16, 16, 16, 16]
    assert [n for _, n, _ in _burst_after(4, cap=0)] == [1, 16, 16, 16, 15]


def test_decode_reserves_k_plus_1_per_inflight_window():
    k, bs = 3, 4
    sched = Scheduler(SchedulerConfig(num_speculative_tokens=k, num_blocks=64, block_size=bs))
    req = make("a", 8, max_tokens=100)
    sched.add(req)
    first = sched.schedule()  # prefill 8 -> 2 blocks
    assert len(req.block_ids) == 2
    req.num_drafts = k  # what the speculation policy chose for its first window
    second = sched.schedule()  # decode window planned while the prefill is in flight
    assert second.rows[0].num_tokens == k + 1 and not second.rows[0].is_prefill
    assert len(req.block_ids) == -(-(8 + k + 1) // bs)
    sched.schedule()  # a second window in flight: room for both upper bounds
    assert len(req.block_ids) == -(-(8 + 2 * (k + 1)) // bs)
    assert first.block_writes[0].block_ids == tuple(req.block_ids[:2])


def test_no_window_is_planned_once_max_tokens_is_surely_reached():
    sched = Scheduler(SchedulerConfig(num_blocks=64, block_size=4))
    req = make("a", 4, max_tokens=2)
    sched.add(req)
    assert len(sched.schedule().rows) == 1  # prefill, emits token 1
    assert len(sched.schedule().rows) == 1  # decode, emits token 2
    assert sched.schedule().is_empty  # two emitting steps in flight already cover max_tokens


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("k", [0, 3])
def test_preemption_completes_every_request_with_the_same_tokens(depth, k):
    def run(num_blocks):
        sched = Scheduler(SchedulerConfig(max_num_seqs=8, num_speculative_tokens=k,
                                          num_blocks=num_blocks, block_size=4))
        reqs = [make(f"r{i}", 6 + i, max_tokens=24, arrival=i) for i in range(8)]
        drive(sched, reqs, depth=depth, k=k)
        assert sched.blocks.num_free_blocks == num_blocks and sched.num_free_slots == 8
        assert not sched.running and not sched.waiting
        return sched, {r.request_id: r.output_ids for r in reqs}

    roomy, expected = run(num_blocks=400)
    tight, got = run(num_blocks=20)
    assert roomy.num_preemptions == 0 and tight.num_preemptions > 0
    assert got == expected
    assert all(len(tokens) == 24 for tokens in got.values())


def test_preemption_picks_the_latest_arrival():
    sched = Scheduler(SchedulerConfig(num_blocks=8, block_size=4))
    a, b = make("a", 8, max_tokens=12, arrival=0), make("b", 8, max_tokens=12, arrival=1)
    sched.add(a)
    sched.add(b)
    plan = sched.schedule()  # both prefills: 4 blocks
    rng = np.random.default_rng(0)
    commit_plan(sched, plan, rng, 0)
    while not sched.num_preemptions:
        commit_plan(sched, sched.schedule(), rng, 0)
    assert b.status.value == "waiting" and a.status.value == "running"
    assert b.prefill_ids.shape[0] == 8 + len(b.output_ids)


def test_abort_in_every_phase_leaves_no_state():
    cfg = SchedulerConfig(max_num_seqs=4, max_prefill_chunk=8, num_speculative_tokens=2,
                          num_blocks=40, block_size=4)
    sched = Scheduler(cfg)
    queued, prefilling, decoding = make("q", 4, arrival=5), make("p", 30, arrival=1), make("d", 4, arrival=0)
    for r in (decoding, prefilling):
        sched.add(r)
    rng = np.random.default_rng(0)
    plans = [sched.schedule(), sched.schedule()]
    commit_plan(sched, plans[0], rng, 2)
    sched.add(queued)
    inflight = sched.schedule()
    assert prefilling.is_prefilling and not decoding.is_prefilling
    for r in (queued, prefilling, decoding):
        assert sched.abort(r.request_id) is r and r.finish_reason is FinishReason.ABORT
    commit_plan(sched, plans[1], rng, 2)  # results of launched steps arrive after the abort
    commit_plan(sched, inflight, rng, 2)
    assert all(not sched.is_current(row) for row in inflight.rows)
    assert sched.abort("d") is None  # after the last token: nothing left to drop
    assert sched.blocks.num_free_blocks == 40 and sched.num_free_slots == 4
    assert sched.num_unfinished == 0 and sched.schedule().is_empty


def test_request_that_can_never_fit_is_rejected_at_intake():
    sched = Scheduler(SchedulerConfig(num_blocks=4, block_size=4))
    with pytest.raises(ValueError):
        sched.add(make("big", 10, max_tokens=10))


def test_max_model_len_is_enforced_at_intake():
    sched = Scheduler(SchedulerConfig(num_blocks=64, block_size=4, max_model_len=20))
    sched.add(make("ok", 10, max_tokens=10))
    with pytest.raises(ValueError):
        sched.add(make("long", 11, max_tokens=10))
