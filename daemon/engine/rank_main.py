"""A rank process: `python -m mtpserve.engine.rank_main <runtime_dir>/config.json --rank R`.

1. Read the launcher's validated configuration; arrange to die with the launcher; bind rank and
   instance to every log line; keep the heap a step frees for the next one (host_memory.py).
2. Load the model and build the engine core; warm it up with one short request so the first client
   does not pay for first-call allocations.
3. Attach to the output channel the launcher created, start the request channel and announce
   EngineReady (the HTTP process waits for it).
   With tensor_parallel_size > 1 every rank first joins the collective group (environment from
   daemon/engine/tp_env.py); ranks >= 1 then only load their shard and run rank 0's step plans
   (daemon/engine/tp_follower.py): rank 0 alone schedules, talks to the HTTP process and emits.
4. Run the rank loop on uvloop until SIGTERM, SIGINT or the launcher's death; an engine error is
   reported on the output channel (ENGINE_ERROR) before the process exits non-zero.
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import signal
import sys
from pathlib import Path

import uvloop

from mtpserve import log
from mtpserve.config import Config
from mtpserve.host_memory import keep_freed_memory
from mtpserve.instance import instance_name, model_dir, read_config
from mtpserve.lifecycle import die_with_parent, exit_now, watch_parent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mtpserve.engine.rank_main", description="A rank process.")
    parser.add_argument("config", type=Path, help="config.json written by the launcher")
    parser.add_argument("--rank", type=int, default=0)
    args = parser.parse_args(argv)
    parent = die_with_parent()
    config = read_config(args.config)
    log.configure(config.logging.level, config.logging.format, process="rank", rank=args.rank,
                  instance=instance_name(config))
    _dump_stacks_on_fault()
    keep_freed_memory()
    return uvloop.run(serve_rank(config, args.config.resolve().parent, args.rank, parent))


def _dump_stacks_on_fault() -> None:
    """On a fatal signal, every thread's Python stack to stderr, then Paddle's report.

    NOTE: after Paddle's import, which installs its own handler for SIGSEGV and the like: faulthandler
    calls the handler it replaced once it has written the stacks. Paddle's alone said only "No stack trace
    in paddle" when a k=1 rank died of SIGSEGV at 16 streams (2026-11-26), not which op was running."""
    import paddle  # noqa: F401

    faulthandler.enable(all_threads=True)


async def serve_rank(config: Config, runtime_dir: Path, rank: int, parent: int) -> int:
    from mtpserve.engine.rank_loop import StepTimeout
    from mtpserve.engine.rank_setup import EngineSetup
    from mtpserve.engine.tp_group import join_group

    logger = log.get_logger("mtpserve.engine")
    stop = _stop_event(parent)
    tp = join_group(rank, config.parallel.tensor_parallel_size)
    if rank > 0:
        from mtpserve.engine.tp_follower import serve_follower

        return await serve_follower(config, model_dir(config), tp, stop)
    setup = await EngineSetup.start(config, model_dir(config), runtime_dir, rank, tp)
    stuck = False
    try:
        await setup.loop.run(stop)
        return 0
    except Exception as exc:  # NOTE: anything here is fatal for the instance; say so, then exit
        logger.exception("engine failed")
        setup.report_error(f"{type(exc).__name__}: {exc}")
        stuck = isinstance(exc, StepTimeout)
        return 1
    finally:
        await setup.close(device_stuck=stuck)
        if stuck:
            exit_now(1)  # NOTE: the device thread is blocked (e.g. in a collective with a hung peer)


def _stop_event(parent: int) -> asyncio.Event:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.create_task(watch_parent(parent, stop.set))
    return stop


if __name__ == "__main__":
    sys.exit(main())
