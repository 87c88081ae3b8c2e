"""Random interleavings of intake, abort and steps on the synthetic device (hypothesis): whatever the
order, KV pressure, k or overlap, every surviving request gets exactly its reference greedy output,
an aborted one a prefix of it, and the engine returns to its idle state."""

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mtpserve.engine.engine_core import CoreConfig, EngineCore
from mtpserve.engine.request import EngineRequest, FinishReason, SamplingParams
from mtpserve.engine.scheduler import SchedulerConfig
from mtpserve.engine.synthetic_runner import SyntheticConfig, SyntheticRunner

VOCAB, EOS = 300, 0
PROMPTS = [tuple(int(t) for t in np.random.default_rng(i).integers(1, VOCAB, 3 + 5 * (i % 7))) for i in range(12)]


def make_core(k, overlap, num_blocks, max_num_seqs, chunk):
    sched = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=64, max_prefill_chunk=chunk,
                            num_speculative_tokens=k, num_blocks=num_blocks, block_size=4)
    runner = SyntheticRunner(SyntheticConfig(step_time_s=0.0, acceptance_rate=0.6, vocab_size=VOCAB,
                                             num_speculative_tokens=k, max_num_seqs=max_num_seqs,
                                             num_blocks=num_blocks, block_size=4))
    return EngineCore(CoreConfig(sched, overlap=overlap, eos_token_ids=(EOS,)), runner)


def request(i, max_tokens):
    return EngineRequest(f"r{i}", PROMPTS[i], SamplingParams(temperature=0.0, max_tokens=max_tokens))


REFERENCE: dict = {}


def reference(i, max_tokens):
    key = (i, max_tokens)
    if key not in REFERENCE:
        core = make_core(0, False, 256, 1, 64)
        core.add_request(request(i, max_tokens))
        tokens = []
        while core.has_unfinished_requests():
            out = core.step()
            tokens += out.token_ids.tolist()
        core.close()
        REFERENCE[key] = tokens
    return REFERENCE[key]


events = st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(0, 11), st.integers(1, 20)),
    st.tuples(st.just("abort"), st.integers(0, 11)),
    st.tuples(st.just("step"), st.integers(1, 3))), min_size=1, max_size=40)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(events=events, k=st.integers(0, 3), overlap=st.booleans(), num_blocks=st.integers(24, 64),
       max_num_seqs=st.integers(1, 6), chunk=st.sampled_from([4, 16]))
def test_any_interleaving_keeps_outputs_and_accounting(events, k, overlap, num_blocks, max_num_seqs, chunk):
    core = make_core(k, overlap, num_blocks, max_num_seqs, chunk)
    added, tokens, reasons = {}, {}, {}

    def take(out):
        for j, rid in enumerate(out.request_ids):
            assert rid not in reasons, "output after the request finished"
            tokens.setdefault(rid, []).extend(out.tokens_of(j).tolist())
            if out.finish_reasons[j]:
                reasons[rid] = FinishReason(int(out.finish_reasons[j]))

    for event in events:
        if event[0] == "add" and f"r{event[1]}" not in added:
            added[f"r{event[1]}"] = (event[1], event[2])
            core.add_request(request(event[1], event[2]))
        elif event[0] == "abort":
            core.abort_request(f"r{event[1]}")
        elif event[0] == "step":
            for _ in range(event[1]):
                take(core.step())
    while core.has_unfinished_requests():
        take(core.step())
    core.close()

    sched = core.scheduler
    assert sched.blocks.num_free_blocks == num_blocks and sched.num_free_slots == max_num_seqs
    assert set(reasons) == set(added)
    for rid, (i, max_tokens) in added.items():
        ref, got = reference(i, max_tokens), tokens.get(rid, [])
        if reasons[rid] is FinishReason.ABORT:
            assert got == ref[:len(got)]
        else:
            assert got == ref
