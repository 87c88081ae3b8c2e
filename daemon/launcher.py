"""`mtpserve serve`: start the rank processes and the HTTP process, supervise them, stop them cleanly.

1. Check what the start needs (daemon/preflight.py: model directory, config.json, checkpoint headers,
   tokenizer, runtime directory, port, /dev/shm): a failure is one line and an exit before anything loads.
2. Create the output channel (queue + shared-memory ring, 0600, keyed by the instance name; channels of
   dead instances are removed first). The launcher owns it: the engine and the HTTP process attach, and
   the launcher removes it on the way out, however the children ended. Then write the validated
   configuration as JSON into the instance's runtime directory (0700) for the children to read back typed.
3. Start this host's rank processes (0..N-1; with nnodes > 1 this host's slice, each told where the
   collective group meets: docs/tensor-parallel.md), then, on node 0 only, the HTTP process. The HTTP
   process waits for rank 0's EngineReady on the request channel and answers 503 on /health until then.
4. Supervise: if any child exits on its own, the instance is down: stop the others and exit non-zero.
5. On SIGTERM or SIGINT: forward SIGTERM to the HTTP process (it drains), then stop the ranks; a second
   signal stops everything at once. Remove the runtime directory on the way out.
Under systemd (Type=notify) the launcher sends READY=1, WATCHDOG=1 and STOPPING=1 (daemon/readiness.py).
Children die with the launcher: each sets PR_SET_PDEATHSIG and also watches its parent pid.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from structlog.typing import FilteringBoundLogger

from mtpserve import log, preflight
from mtpserve.config import Config
from mtpserve.engine.tp_env import cpu_threads_environment, local_ranks, rank_environment
from mtpserve.instance import instance_name, runtime_dir, write_config
from mtpserve.ipc.output_channel import ChannelBusyError, OutputChannel, QueueBudgetError
from mtpserve.notify import Notifier
from mtpserve.readiness import Readiness, health_url

STOP_GRACE_S = 10.0
FAILURE_GRACE_S = 2.0


def _rank_env(config: Config, rank: int) -> dict | None:
    """A rank's environment: the CPU kernels' threads, the collective runtime's (TP) and Mooncake's
    knobs (PD), else inherited."""
    extra = {}
    if config.parallel.tensor_parallel_size > 1:
        extra.update(rank_environment(config.parallel, rank))
    extra.update(cpu_threads_environment(config.parallel))
    if config.pd.role != "mixed":
        from mtpserve.pd.kv_transfer import mooncake_environment

        extra.update(mooncake_environment())
    return {**os.environ, **extra} if extra else None


def child_commands(config: Config, config_path: Path) -> list[tuple[str, list[str], dict | None]]:
    """This host's ranks (each with the collective runtime's environment); the HTTP process on node 0."""
    python, parallel = sys.executable, config.parallel
    ranks = [(f"rank{r}", [python, "-m", "mtpserve.engine.rank_main", str(config_path), "--rank", str(r)],
              _rank_env(config, r)) for r in local_ranks(parallel)]
    http = [("http", [python, "-m", "mtpserve.server.main", str(config_path)], None)]
    return ranks + (http if parallel.node_rank == 0 else [])


def serve(config: Config) -> int:
    log.configure(config.logging.level, config.logging.format, process="launcher",
                  instance=instance_name(config))
    logger = log.get_logger("mtpserve.launcher")
    try:
        preflight.check(config)
    except preflight.StartupError as exc:
        logger.error("cannot start", error=str(exc))
        return exc.status
    try:
        channel = create_output_channel(config, logger)
    except (ChannelBusyError, OSError) as exc:
        logger.error("cannot create the output channel", error=str(exc))
        return 1
    directory = runtime_dir(config)
    try:
        config_path = write_config(config, directory)
    except OSError as exc:
        channel.remove()
        logger.error("cannot start", error=f"cannot write {directory}: {exc}")
        return preflight.EX_CONFIG
    readiness = Readiness(Notifier(), health_url(config))
    supervisor = Supervisor(child_commands(config, config_path), readiness)
    logger.info("starting", runtime_dir=str(directory), host=config.server.host, port=config.server.port)
    try:
        return supervisor.run(drain_timeout=config.server.drain_timeout)
    finally:
        channel.remove()
        shutil.rmtree(directory, ignore_errors=True)


def create_output_channel(config: Config, logger: FilteringBoundLogger) -> OutputChannel:
    """The configured transport; under `auto`, POSIX unless the kernel refuses this user another queue."""
    ipc = config.ipc

    def create(transport: str) -> OutputChannel:
        return OutputChannel.create(instance_name(config), transport, ring_bytes=ipc.ring_bytes,
                                    max_msg_bytes=ipc.max_msg_bytes, queue_depth=ipc.queue_depth,
                                    chunked=ipc.payload == "chunked")

    if ipc.transport != "auto":
        return create(ipc.transport)
    try:
        return create("posix")
    except QueueBudgetError as exc:
        logger.warning("using the SysV output queue", reason=str(exc))
        return create("sysv")


class Supervisor:
    """Owns the child processes; `run()` returns the launcher's exit status."""

    def __init__(self, commands: list[tuple[str, list[str], dict | None]], readiness: Readiness) -> None:
        self.commands = commands
        self.readiness = readiness
        self.children: dict[str, subprocess.Popen] = {}
        self.stopping = 0  # signals received
        self.logger = log.get_logger("mtpserve.launcher")

    def run(self, drain_timeout: float) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        for name, argv, env in self.commands:
            self.children[name] = subprocess.Popen(argv, env=env, start_new_session=False)
        failed = self._wait_for_exit_or_signal()
        if failed:
            self._stop_after_failure()
            return 1
        return self._stop(drain_timeout)

    def _on_signal(self, signum: int, frame) -> None:
        self.stopping += 1
        if self.stopping == 1:
            self.readiness.stopping()
        self.logger.info("signal", signal=signal.Signals(signum).name, count=self.stopping)
        if self.stopping > 1:
            self._kill_all()

    def _wait_for_exit_or_signal(self) -> str | None:
        """Block until a signal arrives (None) or a child exits on its own (its name)."""
        while not self.stopping:
            for name, child in self.children.items():
                if child.poll() is not None:
                    self.logger.error("child exited", child=name, status=child.returncode)
                    return name
            self.readiness.tick()
            time.sleep(0.1)
        return None

    def _stop(self, drain_timeout: float) -> int:
        """HTTP first (it drains its streams), then the ranks; SIGKILL whatever outlives its grace."""
        http = self.children.get("http")
        if http is not None and http.poll() is None:
            http.send_signal(signal.SIGTERM)
            _wait(http, drain_timeout + STOP_GRACE_S)
        for child in self.children.values():
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
        for child in self.children.values():
            _wait(child, STOP_GRACE_S)
        statuses = [c.returncode for c in self.children.values()]
        return 0 if all(s == 0 for s in statuses) else 1

    def _stop_after_failure(self) -> None:
        """A child died: stop the ranks, but keep the HTTP process up for FAILURE_GRACE_S so clients
        see what happened (/health 503, an SSE error event on every open stream) instead of a reset."""
        deadline = time.monotonic() + FAILURE_GRACE_S
        ranks = [c for name, c in self.children.items() if name != "http"]
        for child in ranks:
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
        for child in ranks:
            _wait(child, STOP_GRACE_S)
        time.sleep(max(0.0, deadline - time.monotonic()))
        self._stop(drain_timeout=0.0)

    def _kill_all(self) -> None:
        for child in self.children.values():
            if child.poll() is None:
                child.kill()


def _wait(child: subprocess.Popen, timeout: float) -> None:
    try:
        child.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()
