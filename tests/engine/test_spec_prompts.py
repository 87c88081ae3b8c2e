"""How the speculation policy prices a step's prompt chunks (engine/spec_cost.py, speculation.py): per number of
depths, apart with a depth and without, what serving adds to them, and their pairs over their prompts' earlier
positions (docs/speculation.md)."""

import numpy as np
import pytest
from mtpserve.engine.request import EngineRequest, Request
from mtpserve.engine.scheduler import SchedulePlan, ScheduledRow
from mtpserve.engine.spec_cost import StepCosts, StepLoad
from mtpserve.engine.spec_curve import Curve
from mtpserve.engine.spec_extra import ServingExtra
from mtpserve.engine.spec_policy import expected_tokens
from mtpserve.engine.speculation import Speculation
from mtpserve.engine.step_plan import StepTiming
from mtpserve.ipc.sampling_params import SamplingParams
from spec_device import memory_bound_ms, rows_of
from spec_rows import K


@pytest.fixture(autouse=True)
def steady(monkeypatch):
    """These tests price a steady load: what serving adds is learnt from its first step."""
    monkeypatch.setattr(ServingExtra, "WARMUP_STEPS", 0)


def test_a_prompt_chunk_is_priced_per_number_of_depths_as_measured():
    """A device where a prompt's last depth costs 1 us a token and each depth before it 4 us (the last
    computes its MLP and head at the frontier only), and a decode step's depth 4 us a token: a step with a
    prompt chunk is priced per number of depths as its samples say, not as that many decode depths (which
    charged one depth over a prompt twice what it cost); a number never measured falls back to those."""
    costs = StepCosts()
    for n in (64, 256, 512):
        for _ in range(Curve.MIN_SAMPLES):
            costs.observe(StepLoad(n, 1, 0, True), 0.0, StepTiming(30e-6 * n, 0.0))
            for depths in (1, 2):
                drafts = (1e-6 + 4e-6 * (depths - 1)) * n
                costs.observe(StepLoad(n, 1, depths, True), 0.0, StepTiming(30e-6 * n, drafts))
    for n in (8, 16, 32, 64):
        for _ in range(Curve.MIN_SAMPLES):
            costs.observe(StepLoad(n, n // 2, 1, False), 0.0, StepTiming(10e-6 * n, 4e-6 * n))
    costs.freeze()
    bare = costs.device(StepLoad(256, 1, 0, True))
    one, two, three = (costs.device(StepLoad(256, 1, depths, True)) - bare for depths in (1, 2, 3))
    assert one == pytest.approx(1e-6 * 256) and two == pytest.approx(5e-6 * 256)
    assert three == pytest.approx(3 * 4e-6 * 256)  # never measured: three decode depths


def test_a_prompt_chunk_s_target_pass_is_priced_apart_with_a_depth_and_without():
    """A device whose prompt chunks take 30 us a token in the target pass where a depth reads every
    position's hidden state and 25 us where none runs (the last block's MLP at the logit rows alone):
    each kind of step is priced with its own samples; before any depth-0 chunk is measured, with the
    other kind's."""
    costs = StepCosts()
    for n in (64, 256, 512):
        for _ in range(Curve.MIN_SAMPLES):
            costs.observe(StepLoad(n, 1, 1, True), 0.0, StepTiming(30e-6 * n, 1e-6 * n))
    assert costs.device(StepLoad(256, 1, 0, True)) == pytest.approx(30e-6 * 256)
    for n in (64, 256, 512):
        for _ in range(Curve.MIN_SAMPLES):
            costs.observe(StepLoad(n, 1, 0, True), 0.0, StepTiming(25e-6 * n, 0.0))
    costs.freeze()
    assert costs.device(StepLoad(256, 1, 0, True)) == pytest.approx(25e-6 * 256)
    assert costs.device(StepLoad(256, 1, 1, True)) == pytest.approx(31e-6 * 256)


def test_what_serving_adds_to_steps_with_a_prompt_chunk_is_kept_apart_from_decode_steps():
    """Measured at 16 streams on code: serving's decode steps took 1.4 ms more than the profile's curves,
    its steps with a prompt chunk 2.5 ms less (the profile's prefills have no decode rows beside them).
    A decode step is priced with the decode steps' extra alone (one mean over both priced it 0.45 ms
    short, and the policy ran depth 0 where depth 1 was faster), and a prompt token with the difference."""
    extra = ServingExtra()
    assert extra.measured(16, has_prefill=True) == 0.0
    for i in range(ServingExtra.MIN_SAMPLES):
        extra.observe(16, 4.1e-3, 2.7e-3)
    assert extra.measured(16, has_prefill=True) == pytest.approx(1.4e-3)  # none measured: a decode step's
    for i in range(10 * ServingExtra.MIN_SAMPLES):
        extra.observe(16, 4.1e-3, 2.7e-3)
        if i % 10 == 0:
            extra.observe(16, 16e-3, 18.5e-3, has_prefill=True)
    assert extra.seconds(16) == pytest.approx(1.4e-3)
    assert extra.measured(16, has_prefill=True) == pytest.approx(-2.5e-3)
    assert extra.seconds(16, has_prefill=True) == 0.0  # a period is never priced below the quiet profile's

    spec = Speculation(K, adaptive=True, num_slots=16)
    spec.extra = extra
    spec.traffic.chunk_tokens = 256.0
    decode = StepLoad(32, 16, 1, False, 16, 16 * 2 * 300)
    mixed = decode._replace(num_tokens=32 + 256, has_prefill=True, context=decode.context + 256)
    quiet = (spec.costs.device(mixed) - spec.costs.device(decode)) / 256
    assert spec._prefill_cost(decode, 16) == pytest.approx(quiet - 3.9e-3 / 256)
    assert spec.observe(decode, 5e-3, None).period == pytest.approx(spec.costs.device(decode) + 1.4e-3)


def prompt_chunk(width: int, start: int) -> SchedulePlan:
    """One prompt's chunk of `width` tokens from position `start` (its last: it emits, unless it starts at 0)."""
    request = Request(EngineRequest(9, (1, 2, 3), SamplingParams(temperature=0.0)), 9, 0)
    return SchedulePlan((ScheduledRow(request, 0, 9, True, width, start, start > 0),), (), (), ())


def offset_chunk_ms(width: int, start: int, depth: int) -> tuple[float, float]:
    """(target, drafts) of a prompt chunk on a device whose chunk queries cost 0.15 us per earlier position of
    their prompt in the target pass and 0.06 us in each depth but the last (which runs at the frontier only)."""
    target = 0.5 + 0.06 * width + 0.02e-3 * width * width + 0.15e-3 * width * start
    return target, 0.0 if not depth else 0.3 + (depth - 1) * (0.004 * width + 0.06e-3 * width * start)


def test_a_prompt_s_later_chunks_are_priced_with_their_pairs_over_earlier_positions():
    """1,024-token prompts in chunks of 512, 256 tokens out, 4 rows of ~1,000 positions decoding, accepting
    0.9: depth 2's decode steps serve more than depth 1's, but each prompt's second chunk dots its 512 queries
    with the 512 positions before it, in the target pass and in every depth but the last, and depth 1 serves
    4% more in all. Profiled with a chunk at an offset besides prompts prefilled whole, as start-up does,
    the offset's costs are recovered and the policy drafts one; profiled on prompts prefilled whole it
    priced the prompts' share a third low and drafted two."""
    def profiled(offset: bool) -> Speculation:
        spec = Speculation(K, adaptive=True, num_slots=64)
        for rows, kv in [(rows, kv) for rows in (1, 4, 16) for kv in (32, 384)] + [(64, 32)]:
            for depth in range(K + 1):
                load = spec.shape(rows_of(rows, kv, depth + 1), np.full(rows, depth))
                target, drafts = decode_ms(rows, kv, depth)
                for noise in (1.0, 1.1, 1.3):
                    spec.costs.observe(load, 0.0, StepTiming(target * noise * 1e-3, drafts * noise * 1e-3))
        for depth in range(K + 1):
            for width, start in [(64, 0), (256, 0), (512, 0)] + [(256, 512)] * offset:
                load = spec.shape(prompt_chunk(width, start), np.array([depth]))
                target, drafts = offset_chunk_ms(width, start, depth)
                for noise in (1.0, 1.1, 1.3):
                    spec.costs.observe(load, 0.0, StepTiming(target * noise * 1e-3, drafts * noise * 1e-3))
        spec.costs.freeze()
        spec.instance.whole.tried[:] = spec.requests.tried[:] = 1000.0
        spec.instance.whole.accepted[:] = spec.requests.accepted[:] = 900.0
        spec.traffic.observe_finished(1024, 256)
        spec.traffic.observe_chunk(512, 512 * 512 // 2)  # NOTE: a typical chunk: the first at 0, the second at 512
        return spec

    def decode_ms(rows: int, kv: int, depth: int) -> tuple[float, float]:
        target, drafts = memory_bound_ms(rows, kv, depth)
        return target, drafts / 2

    def prompt_token_ms(depth: int) -> float:
        return (sum(offset_chunk_ms(512, 0, depth)) + sum(offset_chunk_ms(512, 512, depth))) / 1024

    gain = expected_tokens(np.full((1, K), 0.9))[0]
    decode_rate = [4 * gain[d] / sum(decode_ms(4, 1000, d)) for d in range(K + 1)]
    # NOTE: every token emitted brings 4 prompt tokens
    rate = [4 * gain[d] / (sum(decode_ms(4, 1000, d)) + 4 * gain[d] * 4 * prompt_token_ms(d)) for d in range(K + 1)]
    assert decode_rate[2] > decode_rate[1]
    assert max(range(K + 1), key=rate.__getitem__) == 1 and rate[1] / rate[2] > 1.03
    spec = profiled(offset=True)
    assert spec.costs.prefix_target == pytest.approx(0.15e-6, rel=0.05)
    assert spec.costs.prefix_drafts[2] == pytest.approx(0.06e-6, rel=0.05)
    assert spec.costs.prefix_drafts[3] == pytest.approx(0.12e-6, rel=0.05)
    assert spec.costs.prefix_drafts[1] == pytest.approx(0.0, abs=1e-12)
    assert spec.choose(rows_of(4, 1000, K + 1)).tolist() == [1] * 4
    assert profiled(offset=False).choose(rows_of(4, 1000, K + 1)).tolist() == [2] * 4
