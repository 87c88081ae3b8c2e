"""`mtpserve router --instance URL...` or `--prefill URL... --decode URL...`: serve until SIGTERM/SIGINT,
then stop listening and give in-flight requests `--drain-timeout` seconds before they are cut
(drain.py); SIGHUP re-reads `--instances-file` (membership.py)."""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import Sequence

import structlog
import uvloop
from aiohttp import web

from mtpserve.notify import Notifier
from mtpserve.router.app import make_app
from mtpserve.router.config import RouterConfig, parse_args
from mtpserve.router.context import ROUTER
from mtpserve.router.membership import reload_file

log = structlog.get_logger("mtpserve.router")
CLEANUP_TIMEOUT_S = 5.0


def main(argv: Sequence[str] | None = None) -> int:
    try:
        config = parse_args(argv)
    except SystemExit as exc:  # NOTE: --help (0) or a bad flag (2, message already printed)
        return int(exc.code or 0)
    _configure_logging(config)
    uvloop.run(serve(config))
    return 0


async def serve(config: RouterConfig) -> None:
    # NOTE: generation requests drain in drain.py before cleanup; what aiohttp still waits for then is
    # /health or /v1/models calls, which are short.
    runner = web.AppRunner(make_app(config), handler_cancellation=True, access_log=None,
                           shutdown_timeout=CLEANUP_TIMEOUT_S)
    await runner.setup()
    await web.TCPSite(runner, config.host, config.port).start()
    log.info("router listening", host=config.host, port=config.port, policy=config.policy,
             instances=list(config.instance_urls), prefill=list(config.prefill_urls),
             decode=list(config.decode_urls))
    notifier = Notifier()
    notifier.ready("routing")  # NOTE: listening is ready; /health says whether backends are up
    watchdog = asyncio.ensure_future(_watchdog(notifier))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, reload_file, runner.app[ROUTER])
    await stop.wait()
    log.info("router stopping", drain_timeout=config.drain_timeout)
    notifier.stopping()
    watchdog.cancel()
    drain = runner.app[ROUTER].drain
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, drain.hurry)  # NOTE: a second signal stops at once
    for site in list(runner.sites):
        await site.stop()  # NOTE: stops listening only; open connections stay for the drain
    cut = await drain.run(config.drain_timeout)
    log.info("router drained", requests_cut=cut)
    await runner.cleanup()


async def _watchdog(notifier: Notifier) -> None:
    """WATCHDOG=1 while the event loop turns: a wedged loop (the router's only worker) stops them."""
    interval = notifier.watchdog_interval_s()
    while interval:
        notifier.watchdog()
        await asyncio.sleep(interval)


def _configure_logging(config: RouterConfig) -> None:
    from mtpserve import log as logging_setup

    logging_setup.configure(config.log_level, config.log_format, process="router")


if __name__ == "__main__":
    sys.exit(main())
