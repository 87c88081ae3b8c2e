"""A rank >= 1 of a tensor-parallel group: load its shard, then run rank 0's plans until the stop plan.

No scheduler, no request channel, no output sender: it never talks to the HTTP process. Its uvloop
loop only waits for the device thread (which blocks in the plan broadcast between steps) or a stop
signal. After a stop signal it still waits `stop_wait_s` for rank 0's stop plan, so an orderly
shutdown ends with status 0 on every rank; a peer's death ends the follow loop with an error
(status 1).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from mtpserve import log
from mtpserve.config import Config
from mtpserve.lifecycle import exit_now
from mtpserve.engine.rank_setup import freeze_heap
from mtpserve.engine.tp_factory import build_follower_runner
from mtpserve.engine.tp_plan_channel import PlanChannel
from mtpserve.model.loader import load_serving_model
from mtpserve.model.parallel import TensorParallel

STOP_WAIT_S = 5.0


async def serve_follower(config: Config, model_dir: Path, tp: TensorParallel, stop: asyncio.Event) -> int:
    logger = log.get_logger("mtpserve.engine")
    model = load_serving_model(model_dir, tp, draft_weight_dtype=config.speculative.draft_weight_dtype)
    runner = build_follower_runner(model, PlanChannel(tp), config.engine, config.speculative)
    freeze_heap()
    logger.info("following rank 0", rank=tp.rank, kv_blocks=runner.config.num_blocks)
    follow = asyncio.wrap_future(runner.follow())
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait([follow, stopped], return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    if not follow.done():
        await asyncio.wait([follow], timeout=STOP_WAIT_S)
    if not follow.done():
        logger.error("no stop plan from rank 0 in time")
        exit_now(1)
    if follow.exception() is not None:
        logger.error("follower failed", error=f"{type(follow.exception()).__name__}: {follow.exception()}")
        exit_now(1)
    logger.info("stop plan received", steps=follow.result())
    runner.close()
    return 0

