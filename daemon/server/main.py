"""The HTTP process: `python -m mtpserve.server.main <runtime_dir>/config.json`.

The launcher writes the validated configuration into the instance's runtime directory (0700) and
starts this process with its path; the request channel's socket lives in the same directory.
1. read the config, 2. load the tokenizer and chat template (no paddle), 3. build the app,
4. serve on uvloop until SIGTERM/SIGINT, 5. drain: keep listening, answer /health and new requests
   with 503 (a load balancer stops routing here) while the streams in flight finish, for at most
   `server.drain_timeout` seconds, 6. end what is left with an error (streams: an SSE error event
   and [DONE]; their engine requests are aborted), 7. close.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import time
from pathlib import Path

import msgspec
import uvloop
from aiohttp import web

from mtpserve import log
from mtpserve.config import Config
from mtpserve.instance import model_dir
from mtpserve.server.app import OpenOutput, make_app
from mtpserve.server.context import CONTEXT
from mtpserve.web.errors import ApiError
from mtpserve.server.text_model import TextModel
from mtpserve.server.tracker import Tracker

FAIL_GRACE_S = 2.0  # for handlers to write the shutdown error to their clients

def run(config: Config, runtime_dir: Path, open_output: OpenOutput) -> int:
    """Serve until SIGTERM/SIGINT, drain, return 0."""
    _configure_logging(config)
    model_name = config.server.served_model_name or model_dir(config).resolve().name
    app = make_app(config, model_name, TextModel.from_dir(model_dir(config)), runtime_dir, open_output)
    return uvloop.run(serve(app, config.server.host, config.server.port, config.server.drain_timeout))


async def serve(app: web.Application, host: str, port: int, drain_timeout: float) -> int:
    """Until SIGTERM/SIGINT (drain, then 0), or until the output path is gone for good (1: the
    launcher sees a child exit and stops the instance, and systemd starts it again)."""
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    health = app[CONTEXT].health
    await asyncio.wait([asyncio.create_task(stop.wait()), asyncio.create_task(health.unrecoverable.wait())],
                       return_when=asyncio.FIRST_COMPLETED)
    if not stop.is_set():
        log.get_logger("mtpserve.server").error("cannot serve again, exiting", reason=health.reason)
        await asyncio.sleep(FAIL_GRACE_S)  # NOTE: the error events already queued reach their clients
        await runner.cleanup()
        return 1
    await drain(app, drain_timeout)
    await runner.cleanup()
    return 0


async def drain(app: web.Application, timeout_s: float) -> None:
    """Refuse new work (503), let in-flight requests finish for at most timeout_s, then end the rest
    with an error (an SSE error event + [DONE] for streams) so no client sees a cut connection."""
    ctx = app[CONTEXT]
    ctx.health.draining()
    if ctx.engine is None:
        return
    tracker = ctx.engine.tracker
    await _wait_idle(tracker, timeout_s)
    if tracker.num_active:
        tracker.fail_all(ApiError(503, "The server is shutting down.", code="shutting_down"))
        await _wait_idle(tracker, FAIL_GRACE_S)


async def _wait_idle(tracker: Tracker, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while tracker.num_active and time.monotonic() < deadline:
        await asyncio.sleep(0.05)


def _configure_logging(config: Config) -> None:
    log.configure(config.logging.level, config.logging.format, process="http")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mtpserve.server.main", description=(__doc__ or "").split("\n")[0])
    parser.add_argument("config", type=Path, help="config.json written by the launcher into the runtime dir")
    args = parser.parse_args(argv)
    config = msgspec.json.decode(args.config.read_bytes(), type=Config)
    from mtpserve.lifecycle import die_with_parent
    from mtpserve.server.output_source import open_output

    die_with_parent()  # NOTE: SIGTERM (a graceful drain) when the launcher dies
    return run(config, args.config.resolve().parent, open_output)


if __name__ == "__main__":
    sys.exit(main())
