"""Router configuration: flags, each also an env var `MTPSERVE_ROUTER_<FLAG>` (flags win).

List-valued env vars (`MTPSERVE_ROUTER_PREFILL`, `MTPSERVE_ROUTER_DECODE`) take URLs separated by
commas or whitespace.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

ENV_PREFIX = "MTPSERVE_ROUTER_"
LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("auto", "json", "console")


@dataclass(frozen=True)
class RouterConfig:
    prefill_urls: tuple[str, ...]
    decode_urls: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 8100
    api_key: str = ""
    health_interval: float = 1.0  # seconds between /health polls of every backend
    connect_timeout: float = 5.0  # seconds to open a TCP connection to a backend
    stream_idle_timeout: float = 30.0  # no byte from a streaming backend for this long = backend failure
    request_timeout: float = 600.0  # whole-response limit of a non-streamed backend call
    drain_timeout: float = 30.0  # on SIGTERM: seconds in-flight requests get before they are cut
    log_level: str = "info"
    log_format: str = "auto"


def parse_args(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> RouterConfig:
    """Flags over env vars over defaults; a bad value exits with status 2 (argparse)."""
    env = os.environ if env is None else env
    parser = build_parser(env)
    args = parser.parse_args(argv)
    if not args.prefill or not args.decode:
        parser.error("at least one --prefill URL and one --decode URL are required")
    for url in [*args.prefill, *args.decode]:
        if not re.match(r"^https?://[^/\s]+/?$", url):
            parser.error(f"backend URL must be http(s)://host:port, got {url!r}")
    for name in ("health_interval", "connect_timeout", "stream_idle_timeout", "request_timeout"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0")
    fields = {k: v for k, v in vars(args).items() if k not in ("prefill", "decode")}
    return RouterConfig(prefill_urls=_urls(args.prefill), decode_urls=_urls(args.decode), **fields)


def build_parser(env: Mapping[str, str]) -> argparse.ArgumentParser:
    d = RouterConfig((), ())
    parser = argparse.ArgumentParser(prog="mtpserve router", description=(
        "PD router: serves the OpenAI API and drives one prefill then one decode instance per request. "
        f"Every flag is also an env var {ENV_PREFIX}<FLAG> (e.g. {ENV_PREFIX}STREAM_IDLE_TIMEOUT)."))
    parser.add_argument("--prefill", nargs="+", metavar="URL", default=_env_list(env, "PREFILL"),
                        help=f"prefill instances, `mtpserve serve --role prefill` (env {ENV_PREFIX}PREFILL, "
                        "comma-separated)")
    parser.add_argument("--decode", nargs="+", metavar="URL", default=_env_list(env, "DECODE"),
                        help=f"decode instances, `mtpserve serve --role decode` (env {ENV_PREFIX}DECODE, "
                        "comma-separated)")
    _add(parser, env, "--host", str, d.host, "address to listen on")
    _add(parser, env, "--port", int, d.port, "port to listen on")
    _add(parser, env, "--api-key", str, d.api_key, "clients must send `Authorization: Bearer KEY`; "
         "the header is passed through to the backends (unset: no check)")
    _add(parser, env, "--health-interval", float, d.health_interval, "seconds between backend /health polls")
    _add(parser, env, "--connect-timeout", float, d.connect_timeout, "seconds to connect to a backend")
    _add(parser, env, "--stream-idle-timeout", float, d.stream_idle_timeout,
         "seconds without a byte from a streaming backend before it counts as failed")
    _add(parser, env, "--request-timeout", float, d.request_timeout,
         "seconds a non-streamed backend call may take in all")
    _add(parser, env, "--drain-timeout", float, d.drain_timeout,
         "on SIGTERM, seconds in-flight requests get to finish")
    _add(parser, env, "--log-level", str, d.log_level, "log level", LOG_LEVELS)
    _add(parser, env, "--log-format", str, d.log_format, "log format (auto: JSON unless a terminal)", LOG_FORMATS)
    return parser


def _add(parser: argparse.ArgumentParser, env: Mapping[str, str], flag: str, kind: type, default: object,
         text: str, choices: tuple[str, ...] | None = None) -> None:
    var = ENV_PREFIX + flag[2:].replace("-", "_").upper()
    shown = "(unset)" if default == "" else default
    try:
        value = kind(env.get(var, default))
    except ValueError:
        parser.error(f"{var} must be a {kind.__name__}, got {env[var]!r}")
    parser.add_argument(flag, type=kind, default=value, choices=choices,
                        help=f"{text} (default: {shown}; env {var})")


def _env_list(env: Mapping[str, str], name: str) -> list[str]:
    return [u for u in re.split(r"[\s,]+", env.get(ENV_PREFIX + name, "")) if u]


def _urls(urls: list[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(u.rstrip("/") for u in urls))  # NOTE: order kept, duplicates dropped
