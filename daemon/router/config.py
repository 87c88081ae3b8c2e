"""Router configuration: flags, each also an env var `MTPSERVE_ROUTER_<FLAG>` (flags win).

List-valued env vars (`MTPSERVE_ROUTER_INSTANCE`, `MTPSERVE_ROUTER_PREFILL`, `MTPSERVE_ROUTER_DECODE`)
take URLs separated by commas or whitespace. Two modes: mixed instances (`--instance`), or PD
(`--prefill` and `--decode`); `--instances-file` names them in a file instead, re-read on SIGHUP.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from mtpserve.router.policy import POLICIES

ENV_PREFIX = "MTPSERVE_ROUTER_"
LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("auto", "json", "console")


@dataclass(frozen=True)
class Members:
    """The instances behind the router: mixed ones, or prefill and decode ones."""

    instance_urls: tuple[str, ...] = ()
    prefill_urls: tuple[str, ...] = ()
    decode_urls: tuple[str, ...] = ()

    def problem(self) -> str | None:
        """Why these cannot be routed to, or None."""
        pd = bool(self.prefill_urls or self.decode_urls)
        if self.instance_urls and pd:
            return "give mixed instances (--instance) or prefill and decode instances, not both"
        if not self.instance_urls and not (self.prefill_urls and self.decode_urls):
            return "at least one --instance URL, or one --prefill URL and one --decode URL, is required"
        for url in [*self.instance_urls, *self.prefill_urls, *self.decode_urls]:
            if not re.match(r"^https?://[^/\s]+/?$", url):
                return f"backend URL must be http(s)://host:port, got {url!r}"
        return None

    @classmethod
    def of(cls, instance: Sequence[str], prefill: Sequence[str], decode: Sequence[str]) -> Members:
        return cls(_urls(instance), _urls(prefill), _urls(decode))

    @classmethod
    def read(cls, path: str) -> Members:
        """A file of one instance per line: `URL` (mixed), `prefill URL` or `decode URL`; `#` comments.
        ValueError naming the line when one is neither."""
        roles: dict[str, list[str]] = {"instance": [], "prefill": [], "decode": []}
        with open(path, encoding="utf-8") as handle:
            for number, raw in enumerate(handle, 1):
                words = raw.split("#", 1)[0].split()
                if not words:
                    continue
                role, url = ("instance", words[0]) if len(words) == 1 else (words[0], words[1])
                if role not in roles or len(words) > 2:
                    raise ValueError(f"{path}:{number}: expected `URL`, `prefill URL` or `decode URL`")
                roles[role].append(url)
        return cls.of(roles["instance"], roles["prefill"], roles["decode"])


@dataclass(frozen=True)
class RouterConfig:
    prefill_urls: tuple[str, ...] = ()
    decode_urls: tuple[str, ...] = ()
    instance_urls: tuple[str, ...] = ()
    instances_file: str = ""  # re-read on SIGHUP
    policy: str = "cache_aware"
    cache_threshold: float = 0.5
    balance_abs_threshold: int = 16
    balance_rel_threshold: float = 1.5
    prefix_keys: int = 1 << 16  # per instance, of 64 characters each
    metrics_interval: float = 5.0  # seconds between scrapes of each instance's /metrics
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
    members = Members.of(args.instance, args.prefill, args.decode)
    if args.instances_file:
        try:
            members = Members.read(args.instances_file)
        except (OSError, ValueError) as exc:
            parser.error(f"--instances-file: {exc}")
    problem = members.problem()
    if problem:
        parser.error(problem)
    for name in ("health_interval", "connect_timeout", "stream_idle_timeout", "request_timeout", "metrics_interval",
                 "prefix_keys", "balance_rel_threshold"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0")
    if not 0 <= args.cache_threshold <= 1:
        parser.error("--cache-threshold must be in [0, 1]")
    fields = {k: v for k, v in vars(args).items() if k not in ("prefill", "decode", "instance")}
    return RouterConfig(prefill_urls=members.prefill_urls, decode_urls=members.decode_urls,
                        instance_urls=members.instance_urls, **fields)


def build_parser(env: Mapping[str, str]) -> argparse.ArgumentParser:
    d = RouterConfig()
    parser = argparse.ArgumentParser(prog="mtpserve router", description=(
        "Router: serves the OpenAI API in front of several mixed instances (--instance), or drives one "
        "prefill then one decode instance per request (--prefill/--decode). "
        f"Every flag is also an env var {ENV_PREFIX}<FLAG> (e.g. {ENV_PREFIX}STREAM_IDLE_TIMEOUT)."))
    parser.add_argument("--instance", nargs="+", metavar="URL", default=_env_list(env, "INSTANCE"),
                        help=f"mixed instances, `mtpserve serve` (env {ENV_PREFIX}INSTANCE, comma-separated)")
    parser.add_argument("--prefill", nargs="+", metavar="URL", default=_env_list(env, "PREFILL"),
                        help=f"prefill instances, `mtpserve serve --role prefill` (env {ENV_PREFIX}PREFILL, "
                        "comma-separated)")
    parser.add_argument("--decode", nargs="+", metavar="URL", default=_env_list(env, "DECODE"),
                        help=f"decode instances, `mtpserve serve --role decode` (env {ENV_PREFIX}DECODE, "
                        "comma-separated)")
    _add(parser, env, "--instances-file", str, d.instances_file, "file of instances, one per line: `URL`, "
         "`prefill URL` or `decode URL` (replaces the URL flags; re-read on SIGHUP)")
    _add(parser, env, "--policy", str, d.policy, "which instance takes a request (the prefill instance under PD; "
         "decode instances are always the least loaded)", POLICIES)
    _add(parser, env, "--cache-threshold", float, d.cache_threshold, "cache_aware: the share of a prompt an "
         "instance must have seen for the prompt to go there")
    _add(parser, env, "--balance-abs-threshold", int, d.balance_abs_threshold, "cache_aware: requests in "
         "flight beyond the least loaded instance past which load wins over the cache (with the next)")
    _add(parser, env, "--balance-rel-threshold", float, d.balance_rel_threshold, "cache_aware: and times the "
         "least loaded instance's count")
    _add(parser, env, "--prefix-keys", int, d.prefix_keys, "cache_aware: prompt chunks (64 characters) "
         "remembered per instance, least recently used forgotten first")
    _add(parser, env, "--metrics-interval", float, d.metrics_interval, "seconds between scrapes of each "
         "instance's /metrics (its prefix-cache hit rate)")
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


def _urls(urls: Sequence[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(u.rstrip("/") for u in urls))  # NOTE: order kept, duplicates dropped
