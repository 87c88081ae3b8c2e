"""Everything a rank process holds while it serves: model, engine core, channels, the rank loop."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mtpserve import log
from mtpserve.config import Config
from mtpserve.engine.engine_core import EngineCore
from mtpserve.engine.engine_factory import build_model_engine
from mtpserve.engine.rank_kv import DecodeExchange, KVExchange, PrefillExchange
from mtpserve.engine.rank_loop import RankLoop
from mtpserve.engine.request import EngineRequest, SamplingParams
from mtpserve.ipc import request_channel as rc
from mtpserve.ipc import wire
from mtpserve.ipc.output_channel import OutputChannel
from mtpserve.launcher import instance_name
from mtpserve.model.loader import load_model
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
        model = load_model(model_dir, tp)
        core = build_core(model, config, tp)
        warm_up(core)
        output = OutputChannel.attach(instance_name(config))
        sender = OutputSender(output.address, rank=rank, vocab_size=core.runner.vocab_size,
                              max_pending_bytes=config.ipc.max_pending_bytes)
        channel = await rc.RequestChannelServer.start(runtime_dir)
        step_timeout = config.engine.step_timeout if tp.size > 1 else None
        loop = RankLoop(core, channel, sender, step_timeout_s=step_timeout)
        loop.kv = kv_exchange(config, core, channel, loop.wake.set)
        channel.set_ready(engine_ready(core, model_dir, config, instance_name(config), loop.kv))
        logger.info("engine ready", model=str(model_dir), kv_blocks=core.config.scheduler.num_blocks,
                    num_speculative_tokens=core.config.scheduler.num_speculative_tokens,
                    role=loop.kv.role, kv_session=loop.kv.session)
        return cls(core, output, sender, channel, loop)

    def report_error(self, message: str) -> None:
        self.sender.send_control(wire.ControlCode.ENGINE_ERROR, message[:1024])

    async def close(self, device_stuck: bool = False) -> None:
        """`device_stuck`: a step never finished; leave the engine core alone (closing it would wait)."""
        await self.channel.close()
        self.loop.kv.close()
        self.sender.close()
        self.output.close()
        if device_stuck:
            return
        try:
            self.core.close()
        except Exception as exc:  # noqa: BLE001 - a failed step (e.g. a dead peer rank) was reported already
            log.get_logger("mtpserve.engine").warning("engine close", error=f"{type(exc).__name__}: {exc}")


def build_core(model, config: Config, tp: TensorParallel = SINGLE) -> EngineCore:
    if tp.size == 1:
        return build_model_engine(model, **engine_parameters(config), kv_lease_s=config.pd.kv_lease_timeout)
    from mtpserve.engine.tp_factory import build_leader_engine
    from mtpserve.engine.tp_plan_channel import PlanChannel

    return build_leader_engine(model, PlanChannel(tp), **engine_parameters(config))


def engine_parameters(config: Config) -> dict:
    """The configuration tree mapped onto the engine factories' parameters."""
    e = config.engine
    return dict(num_speculative_tokens=config.speculative.num_speculative_tokens,
                max_num_seqs=e.max_num_seqs, max_num_batched_tokens=e.max_num_batched_tokens,
                max_prefill_chunk=e.max_prefill_chunk, block_size=e.block_size,
                num_kv_blocks=e.num_kv_blocks, kv_cache_mb=e.kv_cache_mb,
                max_model_len=e.max_model_len, enable_overlap=e.enable_overlap, seed=e.seed)


def warm_up(core: EngineCore) -> None:
    """One short greedy request end to end, results discarded."""
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=5)
    core.add_request(EngineRequest(-1, WARMUP_PROMPT, params))
    while core.has_unfinished_requests():
        core.step()


def engine_ready(core: EngineCore, model_dir: Path, config: Config, output: str,
                 kv: KVExchange) -> rc.EngineReady:
    sched = core.config.scheduler
    return rc.EngineReady(
        model_name=config.server.served_model_name or model_dir.resolve().name,
        max_model_len=sched.max_model_len, vocab_size=core.runner.vocab_size,
        eos_token_ids=list(core.config.eos_token_ids),
        num_speculative_tokens=sched.num_speculative_tokens, num_kv_blocks=sched.num_blocks,
        kv_block_size=sched.block_size, output_channel=output, role=kv.role, kv_session=kv.session,
        kv_layout=kv.layout)


def kv_exchange(config: Config, core: EngineCore, channel: rc.RequestChannelServer,
                wake) -> KVExchange:
    """The PD role's KV exchange: a Mooncake session over this rank's registered KV buffers."""
    pd = config.pd
    if pd.role == "mixed":
        return KVExchange()
    from mtpserve.pd.kv_layout import kv_buffers, layout_of, regions_of
    from mtpserve.pd.kv_transfer import KVTransferAgent

    runner = core.runner
    buffers = kv_buffers(runner.kv, runner.proposer.kv if runner.proposer else [])
    layout = layout_of(buffers, core.config.scheduler.block_size)
    agent = KVTransferAgent.start(pd.kv_host, pd.transfer_protocol, regions_of(buffers))
    if pd.role == "prefill":
        return PrefillExchange(core, channel, agent, layout)
    return DecodeExchange(core, agent, layout, pd.transfer_threads, pd.transfer_delay, wake)
