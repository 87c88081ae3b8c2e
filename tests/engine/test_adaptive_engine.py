"""Adaptive speculation in the engine with the real model: a load that swings across the policy's
switching point changes the depth step by step, greedy output stays exactly plain greedy's, and no
switch stalls a step."""

import numpy as np
import pytest

from mtpserve.engine.engine_core import CoreConfig, EngineCore
from mtpserve.engine.model_runner import ModelRunnerConfig, PaddleModelRunner
from mtpserve.engine.request import EngineRequest, SamplingParams
from mtpserve.engine.scheduler import SchedulerConfig
from mtpserve.engine.spec_curve import Curve
from mtpserve.model import small_matmul
from test_model_runner import drafty_model, prompts

# NOTE: whole 32-column panels: each row's result is the same whatever the batch, so greedy output can be
# compared token for token across batch compositions
PACKED = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4)
K, MAX_TOKENS, WAVES = 3, 24, (1, 8, 1, 8, 1, 8)

pytestmark = pytest.mark.skipif(not small_matmul.available(), reason="batch-independent rows need the fused blocks")


def make_core(model, k: int, adaptive: bool) -> EngineCore:
    sched = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512, max_prefill_chunk=16, num_speculative_tokens=k,
                            num_blocks=256, block_size=8)
    runner = PaddleModelRunner(model, ModelRunnerConfig(max_num_seqs=8, num_blocks=256, block_size=8,
                                                        num_speculative_tokens=k))
    return EngineCore(CoreConfig(sched, adaptive_speculation=adaptive), runner)


def saturated_device(core: EngineCore) -> None:
    """Step costs of a device that takes 2 ms a step and 1 ms a token: drafting pays for one row, whose
    step is mostly fixed cost, and not for eight. Frozen, so where the switch falls does not depend on
    how fast this machine runs the tiny model."""
    costs = core.speculation.costs
    for curve in (costs.decode, costs.mixed, costs.mixed_alone):
        for n in (1, 2, 4, 8, 16, 32, 64, 128):
            for _ in range(Curve.MIN_SAMPLES):
                curve.observe(n, 2e-3 + 1e-3 * n)
    costs.depth = Curve(prior=lambda n: 0.0)
    costs.observe = lambda *args: None  # type: ignore[method-assign]
    core.speculation.extra.observe = lambda *args: None  # type: ignore[method-assign]


def run_waves(core: EngineCore, texts: list[tuple[int, ...]]) -> tuple[dict[int | str, list[int]], list[int]]:
    """Each wave's requests together, the next wave once they finish; returns the outputs and the
    steps each wave took."""
    outs: dict[int | str, list[int]] = {}
    steps, start = [], 0
    for size in WAVES:
        for i in range(start, start + size):
            core.add_request(EngineRequest(f"r{i}", texts[i], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                                             ignore_eos=True)))
        start += size
        steps.append(drain(core, outs))
    core.close()
    return outs, steps


def drain(core: EngineCore, outs: dict[int | str, list[int]]) -> int:
    """Step until every request finished, adding each one's tokens to `outs`; returns the steps taken."""
    n = 0
    while core.has_unfinished_requests():
        out = core.step()
        n += 1
        for j, rid in enumerate(out.request_ids):
            outs.setdefault(rid, []).extend(out.tokens_of(j).tolist())
    return n


def test_a_load_swinging_across_the_switching_point_keeps_greedy_output_and_never_stalls():
    model = drafty_model(scale=0.5, **PACKED)
    texts = prompts(sum(WAVES), seed=3)
    plain, _ = run_waves(make_core(model, 0, adaptive=False), texts)
    core = make_core(model, K, adaptive=True)
    saturated_device(core)
    depths: list[int] = []
    choose = core.speculation.choose

    def recording(plan):
        drafts = choose(plan)
        depths.append(int(drafts.max(initial=0)))
        return drafts

    core.speculation.choose = recording  # type: ignore[method-assign]
    adaptive, steps = run_waves(core, texts)
    assert adaptive == plain
    assert all(len(tokens) == MAX_TOKENS for tokens in adaptive.values())
    # the depth followed the load both ways, every wave: drafting alone, none at eight rows
    assert int(np.count_nonzero(np.diff(depths))) >= len(WAVES) - 1 and max(depths) >= 1 and 0 in depths
    # no stall: a wave takes at most a step per token, its prompt chunks and the pipeline's few
    chunks = max(-(-len(t) // 16) for t in texts)
    assert max(steps) <= MAX_TOKENS + chunks + 3


def test_after_the_start_up_profile_the_engine_serves_and_reports_its_stats():
    """The rank's own sequence: warm-up profile (which freezes the device curves), serving, then the
    heartbeat's stats through the wire codec (a numpy scalar there once killed the engine)."""
    import msgspec

    from mtpserve.engine.rank_loop import engine_stats
    from mtpserve.engine.rank_setup import profile_steps

    model = drafty_model(scale=0.5, **PACKED)
    core = make_core(model, K, adaptive=True)
    profile_steps(core, batches=(1, 4), num_windows=4)
    costs = core.speculation.costs
    assert costs.frozen
    # NOTE: every number of depths has been timed over prompt chunks, and the profile's steps are not serving's
    assert all(costs.mixed_drafts(depths)._known()[0] for depths in range(1, K + 1))
    assert core.speculation.extra.measured(1) == 0.0
    texts = prompts(8, seed=5)
    for i, text in enumerate(texts):
        core.add_request(EngineRequest(f"s{i}", text, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)))
    steps = 0
    while core.has_unfinished_requests():
        core.step()
        steps += 1
    stats = engine_stats(core, steps)
    assert stats.spec_predicted_seconds > 0 and stats.spec_measured_seconds > 0
    assert type(stats.spec_predicted_seconds) is float
    msgspec.msgpack.encode(stats)
    core.close()


def test_the_start_up_profile_fits_a_short_model_length():
    """A model length shorter than the profile's prompts and windows: the profile's requests fit in it (one
    refused would kill the rank before it is ready)."""
    from mtpserve.engine.rank_setup import profile_steps

    sched = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512, max_prefill_chunk=16, num_speculative_tokens=K,
                            num_blocks=256, block_size=8, max_model_len=100)
    runner = PaddleModelRunner(drafty_model(scale=0.5, **PACKED),
                               ModelRunnerConfig(max_num_seqs=8, num_blocks=256, block_size=8, num_speculative_tokens=K))
    core = EngineCore(CoreConfig(sched, adaptive_speculation=True), runner)
    profile_steps(core, batches=(1, 4), num_windows=4)
    assert core.speculation.costs.frozen and not core.has_unfinished_requests()
    core.close()


@pytest.mark.parametrize("adaptive", [False, True])
def test_each_request_drafts_within_its_own_cap_in_a_slot_another_request_held(adaptive):
    """The policy reads a request's cap and whether a seed pins its drafts when the request takes its slot.
    Two waves swap their caps over the same slots: every step keeps each request within its own cap (a
    fixed k drafts exactly min(cap, K)), and a seeded sample drafts its cap in every step, adaptive or not."""
    model = drafty_model(scale=0.5, **PACKED)
    texts = iter(prompts(7, seed=9))
    waves: list[dict[int | str, int | None]] = [{"a0": None, "a1": 0, "a2": 1},
                                                 {"b0": 1, "b1": None, "b2": 0, "b3": 2}]
    # NOTE: b3 is a seeded sample: its drafts are pinned to its cap
    params = {rid: SamplingParams(temperature=1.0 if rid == "b3" else 0.0, seed=11 if rid == "b3" else None,
                                  max_tokens=12, ignore_eos=True, max_draft_tokens=cap)
              for wave in waves for rid, cap in wave.items()}
    caps = {rid: cap for wave in waves for rid, cap in wave.items()}
    core = make_core(model, K, adaptive=adaptive)
    chosen: list[tuple[int | str, int]] = []
    choose = core.speculation.choose

    def recording(plan):
        drafts = choose(plan)
        chosen.extend((row.request.request_id, int(k)) for row, k in zip(plan.rows, drafts) if row.emits)
        return drafts

    core.speculation.choose = recording  # type: ignore[method-assign]
    slots: dict[int | str, int] = {}
    for wave in waves:
        for rid in wave:
            core.add_request(EngineRequest(rid, next(texts), params[rid]))
        while core.has_unfinished_requests():
            core.step()
            slots.update((r.request_id, r.slot_id) for r in core.scheduler.running)
    core.close()
    assert {slots[rid] for rid in waves[1]} & {slots[rid] for rid in waves[0]}, "the second wave reuses slots"
    assert {rid for rid, _ in chosen} == set(caps)
    for rid, k in chosen:
        own = caps[rid]
        cap = K if own is None else own
        assert k <= cap, (rid, k)
        if rid == "b3" or not adaptive:
            assert k == cap, (rid, k)


def test_greedy_rows_drafting_different_depths_in_one_step_keep_plain_greedy_output():
    """Requests capped at 0, 1, 2 and 3 drafts share every step, so each step's windows differ in width and
    its logits are computed once per distinct position (model_runner._logit_rows): every request's tokens
    are still those of k=0."""
    model = drafty_model(scale=0.5, **PACKED)
    texts = prompts(8, seed=5)
    caps = [0, 1, 2, None, 1, 0, 2, None]

    def outputs(k: int) -> dict[int | str, list[int]]:
        core = make_core(model, k, adaptive=False)
        for i, (text, cap) in enumerate(zip(texts, caps)):
            core.add_request(EngineRequest(f"r{i}", text, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                                         ignore_eos=True, max_draft_tokens=cap)))
        outs: dict[int | str, list[int]] = {}
        drain(core, outs)
        core.close()
        return outs

    mixed, plain = outputs(K), outputs(0)
    assert all(len(v) == MAX_TOKENS for v in plain.values())
    assert mixed == plain
