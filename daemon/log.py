"""Logging through structlog for every mtpserve process.

JSON lines when stdout is not a terminal (journald and log shippers read them), readable console output
otherwise. Context such as rank, instance and request id is bound with `bind()` and appears on every
line the process (or the current asyncio task) logs afterwards. Standard-library loggers (aiohttp,
paddle) go through the same renderer.
"""

from __future__ import annotations

import logging
import sys

import structlog

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
           "error": logging.ERROR}


def configure(level: str = "info", fmt: str = "auto", **context: object) -> None:
    """Set up structlog and stdlib logging once per process; `context` is bound to every line."""
    as_json = fmt == "json" or (fmt == "auto" and not sys.stdout.isatty())
    renderer = structlog.processors.JSONRenderer() if as_json else structlog.dev.ConsoleRenderer()
    shared = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    structlog.configure(
        processors=[*shared, structlog.processors.format_exc_info, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        logger_factory=structlog.PrintLoggerFactory(sys.stdout),
        cache_logger_on_first_use=False,
    )
    _route_stdlib(level, shared, renderer)
    structlog.contextvars.clear_contextvars()
    bind(**context)


def _route_stdlib(level: str, shared: list, renderer) -> None:
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[structlog.stdlib.add_logger_name, *shared],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
    ))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(_LEVELS[level])


def bind(**context: object) -> None:
    """Bind context (rank=, instance=, request_id=) to every later line of this process or task."""
    structlog.contextvars.bind_contextvars(**{k: v for k, v in context.items() if v is not None})


def get_logger(name: str) -> structlog.typing.FilteringBoundLogger:
    return structlog.get_logger(name)
