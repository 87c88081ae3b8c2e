"""The `mtpserve` command.

  mtpserve serve [--config PATH] [--<key> VALUE ...]   run the daemon (HTTP process + rank processes)
  mtpserve config [--example] [...]                    print the effective configuration
  mtpserve bench {ipc,engine,serve,soak,peer,...} ...  benchmarks
  mtpserve version                                     print versions

Every configuration key (config/schema.py) is also a flag of `serve` and `config`; `--help` shows each
with its default. A configuration problem exits with status 2 and one line, before anything starts.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import os
import platform
import sys
from collections.abc import Sequence

from mtpserve import __version__
from mtpserve.config import Config, ConfigError, as_toml, iter_keys, load_config

BENCH_MODULES = ("mtpserve.bench.ipc", "mtpserve.bench.engine", "mtpserve.bench.serve",
                 "mtpserve.bench.tp", "mtpserve.bench.kv", "mtpserve.bench.pd",
                 "mtpserve.bench.soak", "mtpserve.router.bench", "mtpserve.bench.peer", "mtpserve.bench.prefix",
                 "mtpserve.bench.chat", "mtpserve.bench.route", "mtpserve.bench.attention",
                 "mtpserve.bench.sampling")
EXIT_CONFIG = 2


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["router"]:
        from mtpserve.router.main import main as router_main  # NOTE: its own flags (docs/router.md)

        return router_main(argv[1:])
    args = build_parser(with_bench=argv[:1] == ["bench"]).parse_args(argv)
    if not hasattr(args, "func"):
        build_parser(with_bench=False).print_help()
        return EXIT_CONFIG
    return args.func(args)


def build_parser(with_bench: bool) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mtpserve", description=(__doc__ or "").split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"mtpserve {__version__}")
    commands = parser.add_subparsers(title="commands", metavar="COMMAND")
    serve = commands.add_parser("serve", help="run the daemon: the HTTP API and the rank processes",
                                description="Run the daemon. Precedence: defaults < TOML file < "
                                "MTPSERVE_<SECTION>_<KEY> env vars < flags.")
    _add_config_flags(serve)
    serve.set_defaults(func=run_serve)
    show = commands.add_parser("config", help="print the effective configuration as TOML")
    show.add_argument("--example", action="store_true",
                      help="print the documented example file (config/mtpserve.example.toml)")
    _add_config_flags(show)
    show.set_defaults(func=run_config)
    version = commands.add_parser("version", help="print mtpserve, Python and Paddle versions")
    version.set_defaults(func=run_version)
    commands.add_parser("router", help="the PD router: prefill then decode instance per request "
                        "(`mtpserve router --help`)")
    bench = commands.add_parser("bench", help="benchmarks (ipc, engine, serve, tp, kv, pd, soak, router, peer, "
                                "prefix, chat, route)")
    if with_bench:
        _add_bench_commands(bench)
    return parser


def _add_config_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="PATH", default=os.environ.get("MTPSERVE_CONFIG"),
                        help="TOML configuration file (default: $MTPSERVE_CONFIG, else none)")
    groups: dict[str, argparse._ArgumentGroup] = {}
    for spec in iter_keys():
        group = groups.setdefault(spec.section, parser.add_argument_group(f"[{spec.section}]"))
        shown = "(unset)" if spec.default == "" else str(spec.default).lower() \
            if isinstance(spec.default, bool) else spec.default
        extra = f"; one of {', '.join(spec.meta['choices'])}" if spec.meta["choices"] else ""
        group.add_argument(spec.flag, dest=f"cfg:{spec.dotted}", default=None,
                           metavar=spec.type.__name__.upper(),
                           help=f"{spec.help}{extra} (default: {shown})")


def _add_bench_commands(bench: argparse.ArgumentParser) -> None:
    sub = bench.add_subparsers(title="benchmarks", metavar="BENCHMARK")
    for name in BENCH_MODULES:
        importlib.import_module(name).add_parser(sub)


def config_from_args(args: argparse.Namespace) -> Config:
    cli = {k[4:]: v for k, v in vars(args).items() if k.startswith("cfg:") and v is not None}
    env = {k: v for k, v in os.environ.items() if k.startswith("MTPSERVE_")}
    return load_config(args.config, env=env, cli=cli)


def _config_or_exit(args: argparse.Namespace) -> Config | None:
    try:
        return config_from_args(args)
    except ConfigError as exc:
        print(f"mtpserve: config error: {exc}", file=sys.stderr)
        return None


def run_serve(args: argparse.Namespace) -> int:
    config = _config_or_exit(args)
    if config is None:
        return EXIT_CONFIG
    from mtpserve.launcher import serve

    return serve(config)


def run_config(args: argparse.Namespace) -> int:
    if args.example:
        print(example_toml(), end="")
        return 0
    config = _config_or_exit(args)
    if config is None:
        return EXIT_CONFIG
    print(as_toml(config), end="")
    return 0


def run_version(args: argparse.Namespace) -> int:
    print(f"mtpserve {__version__}")
    print(f"python {platform.python_version()}")
    for dist in ("paddlepaddle", "paddlepaddle-gpu"):
        try:
            print(f"{dist} {importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            pass
    return 0


def example_toml() -> str:
    """The example configuration: every key, its help as a comment, its default as the value."""
    out = ["# mtpserve configuration. Every key, with its default. Precedence: defaults < this file <",
           "# MTPSERVE_<SECTION>_<KEY> environment variables < command-line flags.", ""]
    section = None
    default_toml = {}
    for line in as_toml(Config()).splitlines():
        if " = " in line:
            name, value = line.split(" = ", 1)
            default_toml[(section, name)] = value
        elif line.startswith("["):
            section = line.strip("[]")
    section = None
    for spec in iter_keys():
        if spec.section != section:
            section = spec.section
            out += ([""] if len(out) > 3 else []) + [f"[{section}]"]
        choices = f" One of: {', '.join(spec.meta['choices'])}." if spec.meta["choices"] else ""
        out.append(f"# {spec.help}.{choices} Env: {spec.env_var}; flag: {spec.flag}")
        out.append(f"{spec.name} = {default_toml[(section, spec.name)]}")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    sys.exit(main())
