"""What a start needs from the host and the model directory, checked by the launcher before anything heavy
loads, each failure one sentence that names the thing and the fix.

Every check is cheap (a stat, a bind, a header read): the ranks still load and verify everything
themselves, so a check here only moves an error that would come anyway to the first second, where it is
one line instead of a traceback from a child after the model has loaded.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path

from mtpserve.config import Config
from mtpserve.instance import model_dir, runtime_dir
from mtpserve.model.config import model_config_from_dict
from mtpserve.model.safetensors_reader import CheckpointError, SafetensorsFile, weight_files

EX_CONFIG = 78  # sysexits.h: the unit says RestartPreventExitStatus=78, so systemd does not retry a bad setup


class StartupError(RuntimeError):
    """A start that cannot succeed; the message is the whole story, in one line. `status` is the launcher's
    exit status: EX_CONFIG when only a change of configuration or files helps, 1 when waiting may (a port
    or shared memory that another process is giving back)."""

    def __init__(self, message: str, status: int = EX_CONFIG) -> None:
        super().__init__(message)
        self.status = status


def check(config: Config) -> None:
    """Raise StartupError for the first problem found, in the order a user would fix them."""
    for step in _checks(config):
        step()


def _checks(config: Config) -> list[Callable[[], None]]:
    directory = model_dir(config)
    steps = [lambda: _model_directory(directory), lambda: _model_config(directory),
             lambda: _weights(directory), lambda: _tokenizer(directory),
             lambda: _runtime_directory(runtime_dir(config).parent)]
    if config.parallel.node_rank == 0:  # the HTTP process runs on node 0 only
        steps.append(lambda: _port_free(config.server.host, config.server.port))
    if config.ipc.payload == "ring":
        steps.append(lambda: _shared_memory(config.ipc.ring_bytes))
    return steps


def _model_directory(directory: Path) -> None:
    if not directory.is_dir():
        raise StartupError(f"model directory {directory} does not exist: pass --model DIR, a directory "
                           "holding config.json, *.safetensors and tokenizer.json")


def _model_config(directory: Path) -> None:
    path = directory / "config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise StartupError(f"cannot read {path}: {exc}; the model directory needs the model's "
                           "Hugging Face config.json") from exc
    try:
        model_config_from_dict(raw)
    except (TypeError, ValueError) as exc:  # UnsupportedArchitectureError is a ValueError
        raise StartupError(f"{path}: {exc}") from exc


def _weights(directory: Path) -> None:
    try:
        for path in weight_files(directory):
            SafetensorsFile(path)  # checks the header against the file's size
    except (CheckpointError, OSError) as exc:
        raise StartupError(f"{exc}; copy the checkpoint again") from exc


def _tokenizer(directory: Path) -> None:
    if not (directory / "tokenizer.json").is_file():
        raise StartupError(f"no tokenizer.json in {directory}: copy the model's tokenizer.json next to "
                           "its config.json")


def _runtime_directory(base: Path) -> None:
    try:
        base.mkdir(mode=0o700, parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=base):
            pass
    except OSError as exc:
        raise StartupError(f"runtime directory {base} is not writable ({exc.strerror}): pass "
                           "--runtime-dir DIR, or RuntimeDirectory= in the systemd unit") from exc


def _port_free(host: str, port: int) -> None:
    """The HTTP process binds the same way later (SO_REUSEADDR, as aiohttp does)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise StartupError(f"cannot listen on {host}:{port} ({exc.strerror}): pass --port with a free "
                               "port, or stop the process that holds it", status=1) from exc


def _shared_memory(ring_bytes: int) -> None:
    stats = os.statvfs("/dev/shm")
    free = stats.f_bavail * stats.f_frsize
    if free < ring_bytes:
        raise StartupError(f"/dev/shm has {free >> 20} MiB free and the output ring needs {ring_bytes >> 20} "
                           "MiB: pass a smaller --ipc-ring-bytes, free /dev/shm, or enlarge it "
                           "(docker run --shm-size)", status=1)
