"""Load the configuration tree once, at start.

Precedence, lowest to highest:
  1. the defaults in config/schema.py
  2. the TOML file (`--config PATH`, else $MTPSERVE_CONFIG, else none)
  3. environment variables MTPSERVE_<SECTION>_<KEY> (e.g. MTPSERVE_ENGINE_MAX_NUM_SEQS=32)
  4. command-line flags (e.g. --max-num-seqs 32)
Every value is checked once, here: unknown keys, wrong types and out-of-range values raise ConfigError
with one line naming the key, the source and the reason.
"""

from __future__ import annotations

import dataclasses
import tomllib
import typing
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

from .schema import Config

ENV_PREFIX = "MTPSERVE_"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


class ConfigError(ValueError):
    """A configuration problem, stated in one line."""


class KeySpec(NamedTuple):
    section: str
    name: str
    type: type
    default: Any
    help: str
    meta: Mapping[str, Any]

    @property
    def dotted(self) -> str:
        return f"{self.section}.{self.name}"

    @property
    def env_var(self) -> str:
        return f"{ENV_PREFIX}{self.section}_{self.name}".upper()

    @property
    def flag(self) -> str:
        return self.meta["flag"] or "--" + self.name.replace("_", "-")


def iter_keys() -> Iterator[KeySpec]:
    """Every key of the tree, section by section, in declaration order."""
    for section in dataclasses.fields(Config):
        section_cls = typing.get_type_hints(Config)[section.name]
        hints = typing.get_type_hints(section_cls)
        for f in dataclasses.fields(section_cls):
            yield KeySpec(section.name, f.name, hints[f.name], f.default, f.metadata["help"], f.metadata)


def load_config(path: str | Path | None = None, env: Mapping[str, str] | None = None,
                cli: Mapping[str, str] | None = None) -> Config:
    """Build the tree from defaults, the TOML file, env vars and CLI strings (keyed "section.key")."""
    specs = {spec.dotted: spec for spec in iter_keys()}
    values: dict[str, Any] = {}
    if path is not None:
        values.update(_from_toml(Path(path), specs))
    values.update(_from_env(env or {}, specs))
    values.update(_from_cli(cli or {}, specs))
    config = _build(values)
    _check_cross_field(config)
    return config


def _from_toml(path: Path, specs: Mapping[str, KeySpec]) -> dict[str, Any]:
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {path}: not found") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path}: TOML syntax error: {exc}") from None
    values = {}
    for section, table in raw.items():
        if not isinstance(table, dict):
            raise ConfigError(f"{section} (in {path}): expected a [{section}] table")
        for name, value in table.items():
            spec = _spec(specs, f"{section}.{name}", f"in {path}")
            values[spec.dotted] = _check(spec, _typed(spec, value, f"in {path}"), f"in {path}")
    return values


def _from_env(env: Mapping[str, str], specs: Mapping[str, KeySpec]) -> dict[str, Any]:
    by_var = {spec.env_var: spec for spec in specs.values()}
    values = {}
    for var, text in env.items():
        if not var.startswith(ENV_PREFIX) or var == ENV_PREFIX + "CONFIG":
            continue
        if var not in by_var:
            raise ConfigError(f"{var}: unknown environment variable (keys: MTPSERVE_<SECTION>_<KEY>)")
        spec = by_var[var]
        values[spec.dotted] = _check(spec, _parsed(spec, text, f"from {var}"), f"from {var}")
    return values


def _from_cli(cli: Mapping[str, str], specs: Mapping[str, KeySpec]) -> dict[str, Any]:
    values = {}
    for dotted, text in cli.items():
        spec = _spec(specs, dotted, "from the command line")
        values[dotted] = _check(spec, _parsed(spec, text, f"from {spec.flag}"), f"from {spec.flag}")
    return values


def _spec(specs: Mapping[str, KeySpec], dotted: str, where: str) -> KeySpec:
    if dotted not in specs:
        raise ConfigError(f"{dotted} ({where}): unknown key")
    return specs[dotted]


def _parsed(spec: KeySpec, text: str, where: str) -> Any:
    """A value given as text (env var or flag), converted to the key's type."""
    try:
        if spec.type is bool:
            if text.lower() not in _TRUE | _FALSE:
                raise ValueError
            return text.lower() in _TRUE
        return spec.type(text)
    except ValueError:
        raise ConfigError(f"{spec.dotted} ({where}): expected {spec.type.__name__}, got {text!r}") from None


def _typed(spec: KeySpec, value: Any, where: str) -> Any:
    """A value given typed (TOML), checked against the key's type; ints are accepted as floats."""
    is_bool = isinstance(value, bool)
    if spec.type is bool and is_bool or spec.type is str and isinstance(value, str):
        return value
    if spec.type is int and isinstance(value, int) and not is_bool:
        return value
    if spec.type is float and isinstance(value, int | float) and not is_bool:
        return float(value)
    raise ConfigError(f"{spec.dotted} ({where}): expected {spec.type.__name__}, "
                      f"got {type(value).__name__} {value!r}")


def _check(spec: KeySpec, value: Any, where: str) -> Any:
    lo, hi, choices = spec.meta["min"], spec.meta["max"], spec.meta["choices"]
    if lo is not None and value < lo:
        raise ConfigError(f"{spec.dotted} ({where}): must be >= {lo}, got {value}")
    if hi is not None and value > hi:
        raise ConfigError(f"{spec.dotted} ({where}): must be <= {hi}, got {value}")
    if choices is not None and value not in choices:
        raise ConfigError(f"{spec.dotted} ({where}): must be one of {', '.join(choices)}; got {value!r}")
    return value


def _build(values: Mapping[str, Any]) -> Config:
    sections: dict[str, dict[str, Any]] = {}
    for dotted, value in values.items():
        section, name = dotted.split(".", 1)
        sections.setdefault(section, {})[name] = value
    hints = typing.get_type_hints(Config)
    return Config(**{name: hints[name](**kwargs) for name, kwargs in sections.items()})


def _check_cross_field(config: Config) -> None:
    if config.engine.dtype != "float32":
        raise ConfigError(f"engine.dtype: {config.engine.dtype} is not supported; mtpserve computes in float32 "
                          "(Paddle's CPU build has no bfloat16/float16 matmul, and the model path is float32): "
                          "use --dtype float32")
    if config.parallel.node_rank >= config.parallel.nnodes:
        raise ConfigError(f"parallel.node_rank: must be < parallel.nnodes ({config.parallel.nnodes}), "
                          f"got {config.parallel.node_rank}")
    if config.parallel.tensor_parallel_size % config.parallel.nnodes:
        raise ConfigError("parallel.tensor_parallel_size: must be a multiple of parallel.nnodes")
    if config.pd.role != "mixed" and config.parallel.tensor_parallel_size > 1:
        raise ConfigError(f"pd.role: {config.pd.role} needs parallel.tensor_parallel_size 1 "
                          "(one KV transfer session per instance)")


def as_toml(config: Config) -> str:
    """The tree as TOML text (secrets masked): what the daemon logs at start and `mtpserve config` prints."""
    lines = []
    for section in dataclasses.fields(config):
        lines.append(f"[{section.name}]")
        for spec in (s for s in iter_keys() if s.section == section.name):
            value = getattr(getattr(config, section.name), spec.name)
            if spec.meta["secret"] and value:
                value = "***"
            lines.append(f"{spec.name} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(value)
