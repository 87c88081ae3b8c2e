"""Everything a rank process holds while it serves: model, engine core, channels, the rank loop."""

from __future__ import annotations

import asyncio
import gc
import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from mtpserve import log
from mtpserve.config import Config
from mtpserve.engine.engine_core import EngineCore
from mtpserve.engine.engine_factory import build_model_engine, core_config, runner_config
from mtpserve.engine.model_runner import PaddleModelRunner
from mtpserve.engine.rank_loop import RankLoop
from mtpserve.engine.request import EngineRequest
from mtpserve.engine.spec_profile import ProfileCache
from mtpserve.engine.spec_stats import AcceptanceStats
from mtpserve.ipc import request_channel as rc
from mtpserve.ipc import wire
from mtpserve.ipc.output_channel import OutputChannel
from mtpserve.ipc.sampling_params import SamplingParams
from mtpserve.instance import instance_name
from mtpserve.model.loader import load_serving_model
from mtpserve.model.serving_model import ServingModel
from mtpserve.model.parallel import SINGLE, TensorParallel
from mtpserve.ops import OutputSender

WARMUP_PROMPT = (1, 2, 3, 4)


@dataclass
class EngineSetup:
    core: EngineCore
    output: OutputChannel
    sender: OutputSender
    channel: rc.RequestChannelServer
    loop: RankLoop

    @classmethod
    async def start(cls, config: Config, model_dir: Path, runtime_dir: Path, rank: int,
                    tp: TensorParallel = SINGLE) -> EngineSetup:
        logger = log.get_logger("mtpserve.engine")
        model = load_serving_model(model_dir, tp, draft_weight_dtype=config.speculative.draft_weight_dtype)
        channel = await rc.RequestChannelServer.start(runtime_dir)
        wake = asyncio.Event()
        core = build_core(model, config, tp, channel, wake)
        warm_up(core, model_dir, config)
        freeze_heap()
        output = OutputChannel.attach(instance_name(config))
        sender = OutputSender(output.address, rank=rank, vocab_size=core.runner.vocab_size,
                              max_pending_bytes=config.ipc.max_pending_bytes)
        step_timeout = config.engine.step_timeout if tp.size > 1 else None
        loop = RankLoop(core, channel, sender, step_timeout_s=step_timeout, wake=wake)
        channel.set_ready(engine_ready(core, model_dir, config, instance_name(config)))
        logger.info("engine ready", model=str(model_dir), kv_blocks=core.config.scheduler.num_blocks,
                    num_speculative_tokens=core.config.scheduler.num_speculative_tokens,
                    role=core.connector.role, kv_session=core.connector.session)
        return cls(core, output, sender, channel, loop)

    def report_error(self, message: str) -> None:
        self.sender.send_control(wire.ControlCode.ENGINE_ERROR, message[:1024])

    async def close(self, device_stuck: bool = False) -> None:
        """`device_stuck`: a step never finished; leave the engine core alone (closing it would wait)."""
        await self.channel.close()
        self.sender.close()
        self.output.close()
        if device_stuck:
            return
        try:
            self.core.close()
        except Exception as exc:  # noqa: BLE001 - a failed step (e.g. a dead peer rank) was reported already
            log.get_logger("mtpserve.engine").warning("engine close", error=f"{type(exc).__name__}: {exc}")


def build_core(model: ServingModel, config: Config, tp: TensorParallel, channel: rc.RequestChannelServer,
               wake: asyncio.Event) -> EngineCore:
    """Rank 0's core: a tensor-parallel leader, or one rank with the PD role's KV connector."""
    if tp.size > 1:  # NOTE: PD with TP is refused by the configuration
        from mtpserve.engine.tp_factory import build_leader_engine
        from mtpserve.engine.tp_plan_channel import PlanChannel

        return build_leader_engine(model, PlanChannel(tp), config.engine, config.speculative)
    if config.pd.role == "mixed":
        return build_model_engine(model, config.engine, config.speculative)
    from mtpserve.engine.kv_mooncake import build_connector  # NOTE: the mixed role loads no PD code

    cfg = runner_config(model, config.engine, config.speculative)
    runner = PaddleModelRunner(model, cfg)
    connector = build_connector(config.pd, runner, cfg.block_size, channel, wake.set)
    return EngineCore(core_config(model, config.engine, cfg, config.speculative), runner, connector)


def warm_up(core: EngineCore, model_dir: Path, config: Config) -> None:
    """One short greedy request end to end, results discarded; then the speculation policy's step costs."""
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=5)
    core.add_request(EngineRequest(-1, WARMUP_PROMPT, params))
    _drain(core)
    if core.speculation.adaptive:
        step_costs(core, *ProfileCache.for_start(model_dir, config))
    # NOTE: the warm-up's prompts are not clients': neither their blocks nor their counts stay
    core.reset_prefix_cache()
    core.scheduler.prefix.clear_counts()


def step_costs(core: EngineCore, cache: ProfileCache, key: str) -> None:
    """The policy's step costs: the profile an earlier start like this one kept (spec_profile.py), else a profile
    now, kept for the next."""
    logger, started = log.get_logger("mtpserve.engine"), time.monotonic()
    kept = cache.load(key)
    if kept is None:
        profile_steps(core)
        cache.save(key, core.speculation.costs.state())
    else:
        core.speculation.costs.restore(kept)
        _forget(core)
    logger.info("step costs", source="measured" if kept is None else "kept", key=key,
                seconds=round(time.monotonic() - started, 2))


def freeze_heap() -> None:
    """Move everything loading and warming up made out of the collector's sight (gc.freeze).

    NOTE: a rank holds a few hundred thousand long-lived objects (the model's parameters and modules,
    Paddle's and NumPy's modules); each full collection walked them all, in the step's thread,
    while the other thread waited for the GIL. Steps make short-lived objects only, which the young
    generations still collect."""
    gc.collect()
    gc.freeze()


def profile_steps(core: EngineCore, batches: tuple[int, ...] = (1, 4, 16, 64), num_windows: int = 8,
                  passes: int = 3, contexts: tuple[int, int] = (32, 384), long_batches: int = 16,
                  prompts: tuple[int, ...] = (64, 256, 512)) -> None:
    """Run decode steps at a few batch sizes and every depth 0..K, at a short and a long context (prompt
    tokens; the long one up to `long_batches` rows), so the policy's device curves have seen every depth
    and how attention grows with context before the first client, then freeze them (spec_cost.py;
    docs/speculation.md); a few seconds here. Each batch's prompts are prefilled once, at depth K, and
    then decode `num_windows` steps at each depth in turn (a prompt's MTP KV gaps change what its drafts
    are worth, not what a step costs); after each pass, prompts of `prompts` tokens are prefilled alone at
    every depth, the longest as two of the scheduler's chunks (its second is at an offset).

    NOTE: in `passes` rounds, each in another order, so that a burst of other work on the host lands in
    one round's samples of a cell and the cell's lower quartile (Curve.settle) leaves it out. Every row
    has its own prompt: rows sharing one would share its KV blocks, which a cache holds for them all."""
    spec = core.speculation
    if not spec.adaptive:
        return
    config, vocab = core.config.scheduler, core.runner.vocab_size
    sizes = sorted({min(b, config.max_num_seqs) for b in batches})
    # NOTE: half the model's length and of each long row's share of the KV cache, so nothing is preempted
    room = config.num_blocks * config.block_size // (2 * max((b for b in sizes if b <= long_batches), default=1))
    lengths = [max(min(n, room, config.max_model_len // 2 or n), 1) for n in contexts]
    prompt_lengths = tuple(sorted({max(min(n, room, config.max_model_len // 2 or n), 1) for n in prompts}))
    # NOTE: and one prompt of two chunks, so that its second starts at an offset (StepCosts prices a chunk's
    # pairs over earlier positions from it); none where that does not fit. Of two chunks, not a chunk and a
    # shorter one: a chunk of 256 at offset 512 cost 60-170 ns a pair more (one process, the bundled model), a
    # chunk of 512 there 100-210, and serving's chunks of 512 at 512 ~134 (likely: a head's keys and values for
    # 1,024 positions outgrow a core's L2, 512 KB here). Its first chunk is a prompt of one chunk prefilled whole,
    # so that prompt is not prefilled besides it: the profile took 18.5-20.5 s with it, 14.8-17.8 without, in one
    # process on this session's slow host.
    offset = min(2 * config.max_prefill_chunk, room, config.max_model_len // 2 or room)
    if offset > config.max_prefill_chunk:
        prompt_lengths = tuple(sorted(set(prompt_lengths) - {config.max_prefill_chunk} | {offset}))
    loads = [(batch, length) for length in lengths for batch in sizes if length == lengths[0] or batch <= long_batches]
    depths = list(range(spec.max_drafts + 1))
    wanted = num_windows * (spec.max_drafts + 1) * len(depths)
    serial = itertools.count()  # NOTE: every prompt its own, or the prefix cache would shorten the prefills
    for round_ in range(passes):
        for batch, length in loads if round_ % 2 == 0 else reversed(loads):
            ids = [-2 - i for i in range(batch)]
            # NOTE: within the model's length (a request longer than it is refused)
            params = SamplingParams(temperature=0.0, ignore_eos=True,
                                    max_tokens=max(min(wanted, (config.max_model_len or wanted + length) - length), 1))
            for request_id, n in zip(ids, serial):
                prompt = tuple((7 * j + 131 * n) % (vocab - 1) + 1 for j in range(length))
                core.add_request(EngineRequest(request_id, prompt, params))
            _prefill(core, spec.max_drafts)
            for drafts in depths if round_ % 2 == 0 else reversed(depths):
                spec.forced = drafts
                for _ in range(num_windows):
                    core.step()
            for request_id in ids:
                core.abort_request(request_id)
            _drain(core)
        _profile_prompts(core, depths if round_ % 2 == 0 else depths[::-1], serial, prompt_lengths)
    spec.forced = None
    spec.costs.freeze()
    _forget(core)


def _forget(core: EngineCore) -> None:
    """What the warm-up's steps taught but the step costs.

    NOTE: its prompts say nothing of what clients' drafts are worth, nor its steps of serving's."""
    core.speculation.forget_profile()
    core.acceptance = AcceptanceStats(core.speculation.max_drafts)


def _profile_prompts(core: EngineCore, depths: list[int], serial: Iterator[int],
                     lengths: tuple[int, ...]) -> None:
    """One prompt of each length prefilled alone at each depth: what a prompt chunk's depths cost
    (StepCosts.mixed_drafts), which the decode steps cannot say."""
    vocab, params = core.runner.vocab_size, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=1)
    for depth in depths:
        for length, n in zip(lengths, serial):
            core.add_request(EngineRequest(-1, tuple((5 * j + 97 * n) % (vocab - 1) + 1 for j in range(length)),
                                           params))
            _prefill(core, depth)
            _drain(core)


def _prefill(core: EngineCore, depth: int) -> None:
    """Step until every prompt is prefilled, running `depth` MTP depths over the prompt chunks (the
    samples of StepCosts.mixed_drafts)."""
    core.speculation.forced = depth
    scheduler = core.scheduler
    while scheduler.waiting or any(request.is_prefilling for request in scheduler.running):
        core.step()


def _drain(core: EngineCore) -> None:
    while core.has_unfinished_requests():
        core.step()


def engine_ready(core: EngineCore, model_dir: Path, config: Config, output: str) -> rc.EngineReady:
    sched, connector = core.config.scheduler, core.connector
    return rc.EngineReady(
        model_name=config.server.served_model_name or model_dir.resolve().name,
        max_model_len=sched.max_model_len, vocab_size=core.runner.vocab_size,
        eos_token_ids=list(core.config.eos_token_ids),
        num_speculative_tokens=sched.num_speculative_tokens, num_kv_blocks=sched.num_blocks,
        kv_block_size=sched.block_size, output_channel=output, role=connector.role,
        kv_session=connector.session, kv_layout=connector.layout)
