"""What a start that cannot succeed says: one line naming the thing and the fix, a non-zero exit before
anything heavy loads, and nothing left behind (processes, IPC objects, runtime directory)."""

from __future__ import annotations

import json
import resource
import socket
import struct
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from daemon_harness import BUNDLED, Daemon, model_available, post_json
from mtpserve.preflight import EX_CONFIG

pytestmark = pytest.mark.skipif(not model_available(), reason="the bundled model is not present")


def log_records(daemon: Daemon, timeout_s: float = 60) -> tuple[int, list[dict]]:
    """The launcher's exit status and the log records it printed."""
    out, _ = daemon.proc.communicate(timeout=timeout_s)
    return daemon.proc.returncode, [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def start(tmp_path, *args: str, **kw) -> Daemon:
    return Daemon.start(tmp_path, *args, stdout=subprocess.PIPE, **kw)


def test_auto_transport_serves_on_sysv_when_the_posix_queue_budget_is_spent(tmp_path):
    """RLIMIT_MSGQUEUE is one budget for all of a user's POSIX queues (other services included)."""
    daemon = Daemon.start(tmp_path, limits={resource.RLIMIT_MSGQUEUE: 1024})
    try:
        daemon.wait_healthy()
        body = {"model": "m", "prompt": "def f(", "max_tokens": 4, "temperature": 0}
        assert post_json(daemon.url + "/v1/completions", body)["usage"]["completion_tokens"] == 4
        assert daemon.stop() == 0
    finally:
        daemon.kill_everything()
    assert not daemon.leftovers(), daemon.leftovers()


def test_a_spent_posix_queue_budget_is_one_line_and_leaves_nothing(tmp_path):
    daemon = start(tmp_path, "--ipc-transport", "posix", limits={resource.RLIMIT_MSGQUEUE: 1024})
    status, records = log_records(daemon)
    errors = [r for r in records if r.get("level") == "error"]
    assert status != 0 and len(errors) == 1
    assert "RLIMIT_MSGQUEUE" in errors[0]["error"] and "--ipc-transport sysv" in errors[0]["error"]
    assert not daemon.leftovers(), daemon.leftovers()


def model_copy(tmp_path: Path, drop: str = "", replace: dict[str, bytes] | None = None) -> Path:
    """The bundled model as symlinks, with one file dropped or replaced."""
    directory = tmp_path / "model"
    directory.mkdir()
    for source in BUNDLED.iterdir():
        if source.name == drop:
            continue
        target = directory / source.name
        if replace and source.name in replace:
            target.write_bytes(replace[source.name])
        else:
            target.symlink_to(source)
    return directory


def weights() -> bytes:
    return (BUNDLED / "model.safetensors").read_bytes()


def architecture(name: str) -> bytes:
    raw = json.loads((BUNDLED / "config.json").read_text())
    return json.dumps({**raw, "architectures": [name]}).encode()


def corrupt_header(data: bytes) -> bytes:
    (length,) = struct.unpack("<Q", data[:8])
    return data[:8] + b"{" + b"x" * (length - 1) + data[8 + length:]


@dataclass
class Row:
    name: str
    args: Callable[[Path], list[str]]
    says: tuple[str, ...]  # phrases the one line must hold: the thing and the fix
    status: int = EX_CONFIG


def held_port(tmp_path: Path) -> list[str]:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    HELD.append(listener)
    return ["--port", str(listener.getsockname()[1])]


HELD: list[socket.socket] = []
ROWS = [
    Row("port in use", held_port, ("cannot listen on 127.0.0.1:", "--port"), status=1),
    Row("model directory missing", lambda t: ["--model", str(t / "absent")], ("absent does not exist", "--model")),
    Row("config.json unreadable", lambda t: ["--model", str(model_copy(t, replace={"config.json": b"{oops"}))],
        ("config.json", "cannot read")),
    Row("config.json missing", lambda t: ["--model", str(model_copy(t, drop="config.json"))],
        ("config.json", "cannot read")),
    Row("unsupported architecture",
        lambda t: ["--model", str(model_copy(t, replace={"config.json": architecture("GPT2LMHeadModel")}))],
        ("GPT2LMHeadModel", "supported: ['")),
    Row("safetensors truncated",
        lambda t: ["--model", str(model_copy(t, replace={"model.safetensors": weights()[:len(weights()) // 2]}))],
        ("model.safetensors is truncated: tensor ", "copy the checkpoint again")),
    Row("safetensors header corrupt",
        lambda t: ["--model", str(model_copy(t, replace={"model.safetensors": corrupt_header(weights())}))],
        ("model.safetensors: header corrupt", "copy the checkpoint again")),
    Row("no weights", lambda t: ["--model", str(model_copy(t, drop="model.safetensors"))],
        ("no *.safetensors files in",)),
    Row("tokenizer missing", lambda t: ["--model", str(model_copy(t, drop="tokenizer.json"))],
        ("no tokenizer.json in", "copy the model's tokenizer.json")),
    Row("runtime directory not writable", lambda t: ["--runtime-dir", "/dev/null/run"],
        ("runtime directory /dev/null/run is not writable", "--runtime-dir")),
    Row("shared memory too small for the ring", lambda t: ["--ipc-ring-bytes", str(1 << 46)],
        ("/dev/shm has", "--ipc-ring-bytes"), status=1),
]


@pytest.mark.parametrize("row", ROWS, ids=[r.name for r in ROWS])
def test_a_start_that_cannot_succeed_says_why_in_one_line_and_leaves_nothing(tmp_path, row):
    daemon = start(tmp_path, *row.args(tmp_path), "--log-level", "info")
    try:
        status, records = log_records(daemon)
    finally:
        for listener in HELD:
            listener.close()
        HELD.clear()
    errors = [r for r in records if r.get("level") == "error"]
    assert status == row.status and len(errors) == 1, records
    line = errors[0]["error"]
    assert "\n" not in line and all(phrase in line for phrase in row.says), line
    assert not [r for r in records if r.get("event") == "starting"], "children were started"
    assert not daemon.leftovers(), daemon.leftovers()
