"""What the launcher and its children agree on: the instance's name, its private runtime directory, the
model directory, and the validated configuration the launcher writes there for the children to read.

Both sides import this module (and nothing of each other), so a rank process never imports the launcher.
"""

from __future__ import annotations

import os
from pathlib import Path

import msgspec

from mtpserve.config import Config

CONFIG_FILE = "config.json"
BUNDLED_MODEL = Path(__file__).resolve().parent / "default_model"


def runtime_dir(config: Config) -> Path:
    """The instance's private directory: sockets, ownership records, the config the children read."""
    base = config.ipc.runtime_dir or os.environ.get("RUNTIME_DIRECTORY") or f"/tmp/mtpserve-{os.getuid()}"
    return Path(base) / instance_name(config)


def model_dir(config: Config) -> Path:
    """The model directory: engine.model, else the bundled default model."""
    return Path(config.engine.model) if config.engine.model else BUNDLED_MODEL


def instance_name(config: Config) -> str:
    return config.ipc.instance or f"port{config.server.port}"


def write_config(config: Config, directory: Path) -> Path:
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    path = directory / CONFIG_FILE
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(msgspec.json.encode(config))
    return path


def read_config(path: str | os.PathLike) -> Config:
    """What a child calls first: the launcher's validated tree, typed."""
    return msgspec.json.decode(Path(path).read_bytes(), type=Config)
