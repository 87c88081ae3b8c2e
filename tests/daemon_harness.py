"""Start `mtpserve serve` as a user does and look at it from outside: processes, health, IPC objects."""

from __future__ import annotations

import json
import os
import re
import resource
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from mtpserve.ipc.output_channel import remove_stale

ROOT = Path(__file__).resolve().parents[1]
BUNDLED = ROOT / "daemon" / "default_model"


def model_available() -> bool:
    chosen = Path(os.environ.get("MTPSERVE_ENGINE_MODEL", BUNDLED))
    return any(chosen.glob("*.safetensors")) and (chosen / "tokenizer.json").exists()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Daemon:
    proc: subprocess.Popen
    url: str
    instance: str
    runtime_dir: Path
    children: list[int] = field(default_factory=list)

    @classmethod
    def start(cls, tmp_path: Path, *args: str, env: dict | None = None,
              instance: str | None = None, limits: dict[int, int] | None = None,
              stdout: int | None = None) -> Daemon:
        """`limits`: soft resource limits (resource.RLIMIT_*) the launcher and its children start with."""
        port, instance = free_port(), instance or f"t{uuid.uuid4().hex[:10]}"
        runtime = tmp_path / "run"
        argv = [sys.executable, "-m", "mtpserve.cli", "serve", "--port", str(port), "--runtime-dir",
                str(runtime), "--instance", instance, "--log-level", "warning",
                "--served-model-name", "m", *args]
        proc = subprocess.Popen(argv, env={**os.environ, **(env or {})}, stdout=stdout, text=True,
                                preexec_fn=(lambda: _lower_limits(limits)) if limits else None)
        return cls(proc, f"http://127.0.0.1:{port}", instance, runtime / instance)

    def wait_healthy(self, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while self.health() != 200:
            assert self.proc.poll() is None, "mtpserve serve exited during start"
            assert time.monotonic() < deadline, "daemon not healthy in time"
            time.sleep(0.2)
        self.children = child_pids(self.proc.pid)

    def health(self) -> int:
        return status_of(self.url + "/health")

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout_s)
        finally:
            self.kill_everything()

    def kill_everything(self) -> None:
        """SIGKILL what is left, then remove the IPC objects a killed launcher could not."""
        for pid in [self.proc.pid, *self.children]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        wait_until(lambda: not [p for p in [self.proc.pid, *self.children] if pid_alive(p)], 5)
        self.proc.wait(5)  # NOTE: reap it: a zombie launcher still "owns" its IPC objects
        remove_stale(self.instance)

    def leftovers(self) -> list[str]:
        """Processes, shared memory, queues and runtime files this instance left behind."""
        alive = [f"pid {p}" for p in self.children if pid_alive(p)]
        shm = [str(p) for p in Path("/dev/shm").glob(f"*{self.instance}*")]
        mq = [str(p) for p in Path("/dev/mqueue").glob(f"*{self.instance}*")]
        return alive + shm + mq + ([str(self.runtime_dir)] if self.runtime_dir.exists() else [])


def post_json(url: str, body: dict, timeout: float = 120) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def metric(url: str, name: str) -> float:
    """The sum of a metric's samples on /metrics (0 when absent)."""
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    return sum(float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def _lower_limits(limits: dict[int, int]) -> None:
    for which, soft in limits.items():
        resource.setrlimit(which, (soft, resource.getrlimit(which)[1]))


def status_of(url: str, body: dict | None = None) -> int:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status
    except urllib.error.HTTPError as err:
        return err.code
    except OSError:
        return 0


def child_pids(parent: int) -> list[int]:
    """Direct children of `parent`, from /proc."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == parent:
            pids.append(int(stat.parent.name))
    return pids


def pid_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_until(predicate, timeout_s: float, poll_s: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(poll_s)
    return predicate()
