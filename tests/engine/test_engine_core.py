"""The engine core in-process on the synthetic device (zero step time): MTP and overlap never change
greedy output, preemption recomputes to the same tokens, aborts in every phase leave nothing behind."""

import numpy as np
import pytest

from mtpserve.engine.engine_core import CoreConfig, EngineCore
from mtpserve.engine.rank_loop import engine_stats
from mtpserve.engine.request import EngineRequest, FinishReason, SamplingParams
from mtpserve.engine.scheduler import SchedulerConfig
from mtpserve.engine.synthetic_runner import SyntheticConfig, SyntheticRunner

VOCAB, EOS = 500, 0


def make_core(k=0, overlap=True, num_blocks=512, max_num_seqs=16, chunk=16, rate=0.7, adaptive=True):
    sched = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=256, max_prefill_chunk=chunk,
                            num_speculative_tokens=k, num_blocks=num_blocks, block_size=4)
    runner = SyntheticRunner(SyntheticConfig(step_time_s=0.0, acceptance_rate=rate, vocab_size=VOCAB,
                                             num_speculative_tokens=k, max_num_seqs=max_num_seqs,
                                             num_blocks=num_blocks, block_size=4))
    return EngineCore(CoreConfig(sched, overlap=overlap, eos_token_ids=(EOS,), adaptive_speculation=adaptive),
                      runner)


def prompts(n, seed=0):
    gen = np.random.default_rng(seed)
    return [tuple(int(t) for t in gen.integers(1, VOCAB, size=int(gen.integers(3, 40)))) for _ in range(n)]


def greedy(max_tokens=24, **kw):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


class Collector:
    def __init__(self):
        self.tokens, self.reasons, self.after_finish = {}, {}, []

    def take(self, out):
        for i, rid in enumerate(out.request_ids):
            if rid in self.reasons:
                self.after_finish.append(rid)
            self.tokens.setdefault(rid, []).extend(out.tokens_of(i).tolist())
            if out.finish_reasons[i]:
                self.reasons[rid] = FinishReason(int(out.finish_reasons[i]))


def run(core, requests, batch=None, collector=None):
    """Feed requests keeping at most `batch` unfinished; step until everything finished."""
    col = collector or Collector()
    pending = list(requests)
    batch = batch or len(pending)
    while pending or core.has_unfinished_requests():
        while pending and core.scheduler.num_unfinished < batch:
            core.add_request(pending.pop(0))
        col.take(core.step())
    assert_idle(core)
    core.close()
    return col


def assert_idle(core):
    sched = core.scheduler
    assert sched.blocks.num_free_blocks == sched.config.num_blocks
    assert sched.num_free_slots == sched.config.max_num_seqs
    assert not sched.running and not sched.waiting and sched.num_unfinished == 0


def requests_for(texts, **kw):
    return [EngineRequest(f"r{i}", p, greedy(**kw)) for i, p in enumerate(texts)]


@pytest.fixture(scope="module")
def reference():
    texts = prompts(50)
    return texts, run(make_core(k=0, overlap=False), requests_for(texts), batch=1)


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("overlap", [False, True])
def test_mtp_greedy_equals_plain_greedy_at_batch_1(reference, k, overlap):
    texts, ref = reference
    got = run(make_core(k=k, overlap=overlap), requests_for(texts), batch=1)
    assert got.tokens == ref.tokens and got.reasons == ref.reasons


@pytest.mark.parametrize("k", [0, 3])
def test_batch_16_with_overlap_equals_batch_1(reference, k):
    texts, ref = reference
    core = make_core(k=k, overlap=True)
    got = run(core, requests_for(texts), batch=16)
    assert got.tokens == ref.tokens and got.reasons == ref.reasons
    if k:
        assert 1.0 < core.acceptance.mean_acceptance_length <= k + 1


def test_acceptance_counters_follow_the_configured_rate():
    texts = prompts(16, seed=3)
    core = make_core(k=2, rate=0.5, adaptive=False)  # every window drafts 2: the rates are the runner's
    per_request = {}
    for r in requests_for(texts, max_tokens=200, ignore_eos=True):
        core.add_request(r)
    while core.has_unfinished_requests():
        out = core.step()
        for i, rid in enumerate(out.request_ids):
            per_request[rid] = (int(out.num_draft_tokens[i]), int(out.num_accepted_tokens[i]))
    core.close()
    rates = core.acceptance.per_position_rate()
    # position 0 accepted with p=0.5; position 1 needs both: 0.25
    assert abs(rates[0] - 0.5) < 0.05 and abs(rates[1] - 0.25) < 0.05
    assert sum(d for d, _ in per_request.values()) == core.acceptance.num_draft_tokens
    assert sum(a for _, a in per_request.values()) == core.acceptance.num_accepted_tokens


@pytest.mark.parametrize("k", [0, 2])
def test_preemption_under_kv_pressure_keeps_greedy_output(reference, k):
    texts, ref = reference
    core = make_core(k=k, num_blocks=48)
    got = run(core, requests_for(texts), batch=16)
    assert core.scheduler.num_preemptions > 0
    assert got.tokens == ref.tokens and got.reasons == ref.reasons
    stats = engine_stats(core, step_id=0)  # NOTE: what /metrics exports (vllm:num_preemptions_total)
    assert stats.num_preemptions == core.scheduler.num_preemptions
    assert stats.num_discarded_rows == core.num_discarded_rows


def test_stop_rules_run_on_the_device(reference):
    texts, ref = reference
    first = ref.tokens["r0"]
    stop_at = first[5]
    cut = first.index(stop_at) + 1
    reqs = [EngineRequest("stop", texts[0], greedy(stop_token_ids=(stop_at,))),
            EngineRequest("min", texts[0], greedy(stop_token_ids=(stop_at,), min_tokens=cut)),
            EngineRequest("len", texts[0], greedy(max_tokens=3))]
    got = run(make_core(k=2), reqs)
    assert got.tokens["stop"] == first[:cut] and got.reasons["stop"] is FinishReason.STOP
    assert got.tokens["min"][:cut] == first[:cut] and len(got.tokens["min"]) > cut
    assert got.tokens["len"] == first[:3] and got.reasons["len"] is FinishReason.LENGTH


def test_eos_stops_unless_ignored():
    texts = prompts(40, seed=7)
    ref = run(make_core(), requests_for(texts, max_tokens=200))
    stopped = [rid for rid, why in ref.reasons.items() if why is FinishReason.STOP]
    assert stopped, "no prompt produced EOS within 200 tokens"
    rid = stopped[0]
    assert ref.tokens[rid][-1] == EOS
    again = run(make_core(k=1), [EngineRequest(rid, texts[int(rid[1:])], greedy(200, ignore_eos=True))])
    assert len(again.tokens[rid]) == 200 and again.reasons[rid] is FinishReason.LENGTH


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("phase", ["queued", "prefilling", "between_draft_and_verify", "after_last_token"])
def test_abort_in_every_phase_leaves_no_state(reference, overlap, phase):
    texts, ref = reference
    core = make_core(k=2, overlap=overlap, max_num_seqs=2, chunk=4)
    col = Collector()
    victim_prompt = tuple(range(1, 30)) if phase == "prefilling" else texts[1]
    core.add_request(EngineRequest("keep", texts[0], greedy()))
    core.add_request(EngineRequest("victim", victim_prompt, greedy(max_tokens=2 if phase == "after_last_token" else 24)))
    if phase == "queued":
        core.add_request(EngineRequest("victim2", texts[2], greedy()))
        col.take(core.step())
        victim2 = core.scheduler.get("victim2")
        assert victim2 is not None and victim2.status.value == "waiting"
        target = "victim2"
    else:
        target = "victim"
        inflight = (lambda r: r.num_inflight_steps > 0) if overlap else (lambda r: True)
        wanted = {"prefilling": lambda r: r.is_prefilling and r.num_prefill_scheduled > 0,
                  "between_draft_and_verify": lambda r: len(r.output_ids) > 0 and inflight(r),
                  "after_last_token": lambda r: len(r.output_ids) + r.num_inflight_steps >= 2}[phase]
        while (victim := core.scheduler.get("victim")) is not None and not wanted(victim):
            col.take(core.step())
    seen = len(col.tokens.get(target, []))
    if phase == "after_last_token" and not overlap:
        # the last token was collected in the step that produced it: nothing is left to abort
        assert core.scheduler.get(target) is None and not core.abort_request(target)
        assert col.reasons[target] is FinishReason.LENGTH
    else:
        assert core.scheduler.get(target) is not None and core.abort_request(target)
        assert not core.abort_request(target)
    run(core, [], collector=col)
    if target not in col.reasons or col.reasons[target] is not FinishReason.LENGTH:
        assert col.reasons[target] is FinishReason.ABORT
    assert not col.after_finish
    assert len(col.tokens.get(target, [])) == seen  # nothing emitted after the abort
    assert col.tokens["keep"] == ref.tokens["r0"]


def test_overlap_keeps_a_step_on_the_device_between_calls():
    """With overlap, step() returns while the next step runs, so intake and planning happen during
    device time; without it, nothing is in flight between calls."""
    for overlap, expected in ((True, 1), (False, 0)):
        sched = SchedulerConfig(max_num_seqs=4, num_blocks=64, block_size=4)
        runner = SyntheticRunner(SyntheticConfig(step_time_s=0.02, vocab_size=VOCAB, max_num_seqs=4,
                                                 num_blocks=64, block_size=4))
        core = EngineCore(CoreConfig(sched, overlap=overlap), runner)
        core.add_request(EngineRequest("a", (1, 2, 3), greedy(max_tokens=10, ignore_eos=True)))
        in_flight = []
        while core.has_unfinished_requests():
            core.step()
            in_flight.append(core.num_inflight_steps)
        core.close()
        assert max(in_flight) == expected and in_flight.count(expected) >= 8


def test_one_step_lag_rows_are_discarded_and_change_nothing():
    texts = prompts(40, seed=7)
    lagged = make_core(k=2, overlap=True)
    got = run(lagged, requests_for(texts, max_tokens=60))
    plain = make_core(k=2, overlap=False)
    ref = run(plain, requests_for(texts, max_tokens=60))
    assert got.tokens == ref.tokens and got.reasons == ref.reasons
    assert lagged.num_discarded_rows > 0 and plain.num_discarded_rows == 0


async def test_an_asyncio_loop_can_await_the_device_instead_of_blocking(reference):
    """The rank loop's pattern: launch_next, await the future it returns, finish_step; intake
    meanwhile."""
    import asyncio

    texts, ref = reference
    core = make_core(k=2)
    col = Collector()
    pending = requests_for(texts[:10])
    while pending or core.has_unfinished_requests():
        if pending:
            core.add_request(pending.pop(0))  # intake while a step is on the device
        future = core.launch_next()
        result = None if future is None else await asyncio.wrap_future(future)
        col.take(core.finish_step(result))
    core.close()
    assert col.tokens == {rid: ref.tokens[rid] for rid in col.tokens} and len(col.tokens) == 10


def test_requests_that_can_never_run_are_refused_at_intake():
    core = make_core()
    with pytest.raises(ValueError):
        core.add_request(EngineRequest("oov", (1, VOCAB), greedy()))
    with pytest.raises(ValueError):
        core.add_request(EngineRequest("huge", (1, 2), greedy(max_tokens=100_000)))
    assert not core.has_unfinished_requests()
    core.close()


@pytest.mark.parametrize("depth0_chunks,whole", [(2, True), (3, False)])
def test_a_prompt_chunk_before_the_key_start_leaves_no_gap(depth0_chunks, whole):
    """A 30-token prompt in chunks of 8 with a prompt window of 8 has its key start at 20: steps at depth 0 over
    its first two chunks leave its drafts' MTP context whole (no draft reads those positions), one over its
    third chunk (16-23) leaves a gap (Request.mtp_depth)."""
    sched = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=256, max_prefill_chunk=8, num_speculative_tokens=2,
                            num_blocks=64, block_size=4, prompt_window=8)
    runner = SyntheticRunner(SyntheticConfig(step_time_s=0.0, acceptance_rate=0.7, vocab_size=VOCAB,
                                             num_speculative_tokens=2, max_num_seqs=2, num_blocks=64, block_size=4))
    core = EngineCore(CoreConfig(sched, overlap=False, eos_token_ids=(EOS,)), runner)
    prompt = tuple(int(t) for t in np.random.default_rng(4).integers(1, VOCAB, 30))
    core.add_request(EngineRequest("a", prompt, greedy(max_tokens=4)))
    core.speculation.forced = 0
    for _ in range(depth0_chunks):
        core.step()
    core.speculation.forced = 2
    request = core.scheduler.get("a")
    assert request is not None and request.mtp_key_start == 20
    while request.is_prefilling:
        core.step()
    assert request.mtp_depth == (2 if whole else 0)
    core.close()
