"""The start-up profile of step costs kept on disk (`ProfileCache`), so that a restart plans with the curves the
last start measured instead of profiling again.

The profile (rank_setup.profile_steps) times steps at every depth, a few batch sizes and contexts before the
first client: 13-20 s of a start on the standard machine (2 vCPUs), where loading and warming up take ~4.5 s.
A restart on the same host, with the same code, model and engine settings, would measure the same curves up to
the host's noise, so the cache keys a profile by all of those (`profile_key`) and keeps it for a day
(MAX_AGE_S). What serving adds to the curves is learnt online either way (spec_extra.py).

NOTE: a day, because a profile is one draw of a noisy host: two profiles in one process differed by up to
~1.7x in the attention slopes (docs/benchmarks.md, the fifty-third session). Kept for ever, a bad draw would
price every restart's steps; re-measured daily, it lasts at most as long as a daemon that runs a day.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import os
import platform
import time
from pathlib import Path

import msgspec

from mtpserve import log
from mtpserve.config import Config
from mtpserve.engine.spec_cost import CostsState
from mtpserve.engine.tp_env import CPU_THREADS_VAR

FORMAT = 1  # NOTE: raise it when CostsState changes meaning; files of another format are profiled afresh
MAX_AGE_S = 24 * 3600.0
OFF = "off"


class KeptProfile(msgspec.Struct, frozen=True):
    """One file of the cache: what it was measured for, when, and the frozen step-cost model."""

    format: int
    key: str
    measured_at: float  # unix seconds
    costs: CostsState


class ProfileCache:
    """A directory of kept profiles, one file per key; None as the directory turns it off."""

    def __init__(self, directory: Path | None) -> None:
        self.directory = directory

    @classmethod
    def from_setting(cls, setting: str) -> ProfileCache:
        """`speculative.profile_cache`: a directory, OFF, or empty for the default (`default_directory`)."""
        if setting == OFF:
            return cls(None)
        return cls(Path(setting) if setting else default_directory())

    @classmethod
    def for_start(cls, model_dir: Path, config: Config) -> tuple[ProfileCache, str]:
        """This start's cache and key (`profile_key`); the cache off where either cannot be had (an unreadable
        model file, no home directory): a kept profile only saves time, and the start profiles instead."""
        try:
            return cls.from_setting(config.speculative.profile_cache), profile_key(model_dir, config)
        except (OSError, RuntimeError, KeyError) as exc:
            log.get_logger("mtpserve.engine").warning("step profile not kept: no key for this start",
                                                      error=f"{type(exc).__name__}: {exc}")
            return cls(None), ""

    def load(self, key: str) -> CostsState | None:
        """The profile kept under `key`, if there is one of this FORMAT no older than MAX_AGE_S; else None (a file
        that cannot be read is reported and ignored: the caller profiles afresh)."""
        path = self._path(key)
        if path is None or not path.exists():
            return None
        try:
            kept = msgspec.json.decode(path.read_bytes(), type=KeptProfile)
        except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.get_logger("mtpserve.engine").warning("kept step profile unreadable; profiling", path=str(path),
                                                      error=f"{type(exc).__name__}: {exc}")
            return None
        if kept.format != FORMAT or kept.key != key or not 0.0 <= time.time() - kept.measured_at <= MAX_AGE_S:
            return None
        return kept.costs

    def save(self, key: str, costs: CostsState) -> None:
        """Keep `costs` under `key`, replacing the file whole (a start reading it meanwhile sees the old one or
        the new one). A directory that cannot be written is reported, not fatal: the next start profiles."""
        path = self._path(key)
        if path is None:
            return
        partial = path.with_name(f".{path.name}.{os.getpid()}")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            partial.write_bytes(msgspec.json.encode(KeptProfile(FORMAT, key, time.time(), costs)))
            partial.replace(path)
        except OSError as exc:
            log.get_logger("mtpserve.engine").warning("step profile not kept", path=str(path),
                                                      error=f"{type(exc).__name__}: {exc}")
            with contextlib.suppress(OSError):
                partial.unlink(missing_ok=True)

    def _path(self, key: str) -> Path | None:
        return None if self.directory is None else self.directory / f"{key}.json"


def default_directory() -> Path:
    """systemd's CacheDirectory= ($CACHE_DIRECTORY), else the user's XDG cache directory."""
    if cache := os.environ.get("CACHE_DIRECTORY"):
        return Path(cache.split(":")[0]) / "step-profiles"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "mtpserve" / "step-profiles"


def profile_key(model_dir: Path, config: Config) -> str:
    """What a profile's curves depend on, hashed: the host (CPU model and the CPUs the rank may use), the code
    (this package's sources and ops, Paddle's version), the model's files and every engine setting that shapes a
    step (the whole engine and speculative sections but the cache's own setting, the tensor-parallel layout and
    the PD role)."""
    speculative = dataclasses.replace(config.speculative, profile_cache="")
    parts = {
        "host": _host(),
        "code": _code_digest(),
        "model": _model_digest(model_dir),
        "engine": dataclasses.asdict(config.engine),
        "speculative": dataclasses.asdict(speculative),
        "parallel": [config.parallel.tensor_parallel_size, config.parallel.nnodes, config.parallel.cpu_threads,
                     os.environ.get(CPU_THREADS_VAR, "")],
        "role": config.pd.role,
    }
    return hashlib.sha256(msgspec.json.encode(parts, order="sorted")).hexdigest()[:32]


def _host() -> list[str]:
    model = ""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            model = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), "")
    except OSError:
        pass
    return [platform.machine(), model, str(len(os.sched_getaffinity(0)))]


@functools.cache
def _code_digest() -> str:
    """This package's Python sources and compiled ops, and Paddle's version and commit."""
    import paddle.version

    digest = hashlib.sha256(f"{paddle.version.full_version} {paddle.version.commit}".encode())
    root = Path(__file__).resolve().parents[1]
    for path in sorted([*root.rglob("*.py"), *root.rglob("*.so")]):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _model_digest(model_dir: Path) -> str:
    """The model's config files by content, its weight files by name, size and modification time (reading
    gigabytes of weights to hash them would cost more than the profile)."""
    digest = hashlib.sha256()
    for path in sorted(model_dir.iterdir()):
        if not path.is_file():
            continue
        digest.update(path.name.encode())
        if path.suffix == ".json":
            digest.update(path.read_bytes())
        else:
            stat = path.stat()
            digest.update(f"{stat.st_size} {stat.st_mtime_ns}".encode())
    return digest.hexdigest()
