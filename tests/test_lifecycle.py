"""Lifecycle of `mtpserve serve` as systemd runs it: notify, watchdog, graceful drain, clean death.

The daemon is started as a user starts it, with a fake NOTIFY_SOCKET (a datagram socket this test
owns), and judged from outside: what arrives on the socket, HTTP statuses, SSE streams, processes and
IPC objects left behind.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import time
from pathlib import Path

import aiohttp
import pytest

from daemon_harness import Daemon, child_pids, model_available, pid_alive, status_of, wait_until

pytestmark = pytest.mark.skipif(not model_available(), reason="needs the bundled model's weights")
PROMPT = "def parse_args(argv):\n"


class NotifySocket:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.setblocking(False)
        self.received: list[tuple[float, str]] = []

    def drain(self) -> list[tuple[float, str]]:
        while True:
            try:
                self.received.append((time.monotonic(), self.sock.recv(4096).decode()))
            except BlockingIOError:
                return self.received

    def listen_for(self, seconds: float) -> list[tuple[float, str]]:
        """Receive for `seconds`, stamping each message with its arrival time."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self.drain()
            time.sleep(0.05)
        return self.drain()

    def first(self, field: str, timeout_s: float) -> float | None:
        found = lambda: next((t for t, m in self.drain() if field in m.split("\n")), None)  # noqa: E731
        wait_until(lambda: found() is not None, timeout_s)
        return found()

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def notify(tmp_path):
    sock = NotifySocket(tmp_path / "notify.sock")
    yield sock
    sock.close()


def rank_pid(daemon: Daemon) -> int:
    return next(p for p in daemon.children if b"rank_main" in Path(f"/proc/{p}/cmdline").read_bytes())


def completion(max_tokens: int, stream: bool = False) -> dict:
    return {"model": "m", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": stream}


async def stream_events(session: aiohttp.ClientSession, url: str, body: dict,
                        started: asyncio.Event | None = None) -> list[dict | str]:
    """The SSE events of one stream, in order: decoded JSON objects, and "[DONE]"."""
    events: list[dict | str] = []
    async with session.post(url + "/v1/completions", json=body) as response:
        assert response.status == 200
        async for line in response.content:
            text = line.decode().strip()
            if not text.startswith("data: "):
                continue
            payload = text[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
            if started is not None and len(events) == 1:
                started.set()
    return events


async def streams_in_flight(session: aiohttp.ClientSession, daemon: Daemon, n: int,
                            max_tokens: int) -> list[asyncio.Task]:
    """n streaming completions, returned once each has delivered its first event."""
    started = [asyncio.Event() for _ in range(n)]
    tasks = [asyncio.create_task(stream_events(session, daemon.url, completion(max_tokens, True), s))
             for s in started]
    await asyncio.wait_for(asyncio.gather(*(s.wait() for s in started)), 60)
    return tasks


def finish_reason(events: list) -> str | None:
    reasons = [c["finish_reason"] for e in events if isinstance(e, dict) for c in e.get("choices", [])
               if c.get("finish_reason")]
    return reasons[-1] if reasons else None


def test_ready_only_once_servable_then_watchdog_then_stopping(tmp_path, notify):
    env = {"NOTIFY_SOCKET": str(notify.path), "WATCHDOG_USEC": "2000000"}
    daemon = Daemon.start(tmp_path, env=env)
    try:
        ready = notify.first("READY=1", timeout_s=300)
        assert ready is not None, "no READY=1"
        assert status_of(daemon.url + "/v1/completions", completion(4)) == 200
        daemon.children = child_pids(daemon.proc.pid)
        assert wait_until(lambda: sum("WATCHDOG=1" in m for _, m in notify.drain()) >= 2, 10)
        daemon.proc.send_signal(signal.SIGTERM)
        assert notify.first("STOPPING=1", timeout_s=10) is not None
        assert daemon.proc.wait(60) == 0
    finally:
        daemon.kill_everything()


def test_watchdog_pings_stop_when_the_rank_loop_is_stopped(tmp_path, notify):
    watchdog_s = 6.0
    env = {"NOTIFY_SOCKET": str(notify.path), "WATCHDOG_USEC": str(int(watchdog_s * 1e6))}
    daemon = Daemon.start(tmp_path, env=env)
    try:
        assert notify.first("READY=1", timeout_s=300) is not None
        daemon.children = child_pids(daemon.proc.pid)
        rank = rank_pid(daemon)
        os.kill(rank, signal.SIGSTOP)
        stopped_at = time.monotonic()
        pings = [t for t, m in notify.listen_for(watchdog_s + 3) if "WATCHDOG=1" in m]
        assert not [t for t in pings if t > stopped_at + watchdog_s], "pings went on past WatchdogSec"
        assert daemon.health() == 503
        os.kill(rank, signal.SIGCONT)
        assert wait_until(lambda: daemon.health() == 200, 10), "no recovery after SIGCONT"
    finally:
        daemon.stop()


async def test_drain_lets_in_flight_streams_finish(tmp_path):
    daemon = Daemon.start(tmp_path, "--drain-timeout", "10")
    await asyncio.to_thread(daemon.wait_healthy)
    try:
        async with aiohttp.ClientSession() as session:
            streams = await streams_in_flight(session, daemon, 8, max_tokens=48)
            t0 = time.monotonic()
            daemon.proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.3)
            assert await asyncio.to_thread(status_of, daemon.url + "/v1/completions", completion(4)) in (503, 0)
            results = await asyncio.wait_for(asyncio.gather(*streams), 30)
        assert [finish_reason(r) for r in results] == ["length"] * 8
        assert all(r[-1] == "[DONE]" for r in results)
        assert await asyncio.to_thread(daemon.proc.wait, 15) == 0
        assert time.monotonic() - t0 < 10 + 5
        assert wait_until(lambda: not daemon.leftovers(), 5), daemon.leftovers()
    finally:
        daemon.kill_everything()


async def test_zero_drain_ends_streams_with_an_error_event(tmp_path):
    daemon = Daemon.start(tmp_path, "--drain-timeout", "0")
    await asyncio.to_thread(daemon.wait_healthy)
    try:
        async with aiohttp.ClientSession() as session:
            streams = await streams_in_flight(session, daemon, 4, max_tokens=3000)
            t0 = time.monotonic()
            daemon.proc.send_signal(signal.SIGTERM)
            results = await asyncio.wait_for(asyncio.gather(*streams, return_exceptions=True), 30)
        assert await asyncio.to_thread(daemon.proc.wait, 15) == 0
        assert time.monotonic() - t0 < 5
        for events in results:
            assert not isinstance(events, BaseException), events
            assert any(isinstance(e, dict) and "error" in e for e in events), events[-3:]
        assert wait_until(lambda: not daemon.leftovers(), 5), daemon.leftovers()
    finally:
        daemon.kill_everything()


def test_second_signal_stops_at_once(tmp_path):
    daemon = Daemon.start(tmp_path, "--drain-timeout", "60")
    daemon.wait_healthy()
    try:
        daemon.proc.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        t0 = time.monotonic()
        daemon.proc.send_signal(signal.SIGTERM)
        daemon.proc.wait(10)
        assert time.monotonic() - t0 < 5
        assert wait_until(lambda: not [p for p in daemon.children if pid_alive(p)], 5)
    finally:
        daemon.kill_everything()


def test_children_die_with_a_killed_launcher_and_the_next_start_cleans_up(tmp_path):
    daemon = Daemon.start(tmp_path)
    daemon.wait_healthy()
    try:
        os.kill(daemon.proc.pid, signal.SIGKILL)
        daemon.proc.wait(10)
        assert wait_until(lambda: not [p for p in daemon.children if pid_alive(p)], 5), \
            "rank or HTTP process outlived the launcher by 5 s"
        assert [p for p in Path("/dev/shm").glob(f"*{daemon.instance}*")], "expected stale objects"
    finally:
        daemon.kill_everything()
    again = Daemon.start(tmp_path, instance=daemon.instance)
    try:
        again.wait_healthy()
        assert again.stop() == 0
        assert wait_until(lambda: not again.leftovers(), 5), again.leftovers()
    finally:
        again.kill_everything()



def test_a_removed_output_queue_stops_the_instance_for_a_restart(tmp_path):
    """ipcrm of the SysV output queue: nothing can reach the HTTP process any more, so the instance exits
    non-zero (systemd starts it again) instead of answering 503 for ever; it leaves nothing behind."""
    from mtpserve.ipc import sysv
    from mtpserve.ipc.output_channel import OutputChannel

    daemon = Daemon.start(tmp_path, "--ipc-transport", "sysv")
    try:
        daemon.wait_healthy()
        channel = OutputChannel.attach(daemon.instance)
        qid = sysv.find(channel.address.sysv_key)
        channel.close()
        assert qid is not None
        sysv.remove(qid)
        assert daemon.proc.wait(30) != 0
        assert wait_until(lambda: not daemon.leftovers(), 5), daemon.leftovers()
    finally:
        daemon.kill_everything()
