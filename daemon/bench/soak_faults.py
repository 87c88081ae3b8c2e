"""The soak's faults: each one does something a real host does to a real instance, for a few seconds.

A fault is an async function of the running instance; it returns when the fault is over (the process
continued, the socket closed, the file removed). The soak then times how long until a probe request
succeeds again, or sees that the instance exited, where exiting is the designed answer.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import posix_ipc

from mtpserve.bench.serve_launch import Instance
from mtpserve.ipc import names, sysv, wire
from mtpserve.ipc.output_channel import OutputChannel

Fault = Callable[[Instance, aiohttp.ClientSession], Awaitable[None]]
HOLD_S = 5.0
FILL_CAP = 1 << 30


def children(pid: int) -> dict[str, int]:
    """The launcher's children by role: "http", "rank0", "rank1", ... (from their command lines)."""
    found = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if int(stat[1]) != pid:
            continue
        if b"mtpserve.server.main" in argv:
            found["http"] = int(entry.name)
        elif b"--rank" in argv:
            found[f"rank{argv[argv.index(b'--rank') + 1].decode()}"] = int(entry.name)
    return found


def stop_process(role: str) -> Fault:
    async def fault(instance: Instance, session: aiohttp.ClientSession) -> None:
        pid = children(instance.proc.pid)[role]
        os.kill(pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(HOLD_S)
        finally:
            os.kill(pid, signal.SIGCONT)
    fault.__name__ = f"sigstop_{role}"
    return fault


async def slow_reader(instance: Instance, session: aiohttp.ClientSession) -> None:
    """A client that opens a long stream and stops reading it (its socket buffer fills)."""
    body = {"prompt": "def f(", "max_tokens": 2000, "ignore_eos": True, "temperature": 0, "stream": True}
    async with session.post(instance.url + "/v1/completions", json=body) as resp:
        await resp.content.read(64)
        await asyncio.sleep(2 * HOLD_S)


async def unlink_queue(instance: Instance, session: aiohttp.ClientSession) -> None:
    """The output queue removed from under the instance (ipcrm / mq_unlink)."""
    channel = OutputChannel.attach(instance.name)
    try:
        if channel.address.transport is wire.Transport.SYSV:
            qid = sysv.find(channel.address.sysv_key)
            if qid is not None:
                sysv.remove(qid)
        else:
            try:
                posix_ipc.unlink_message_queue(names.queue_name(instance.name))
            except posix_ipc.ExistentialError:
                pass  # NOTE: unlinked by an earlier round; the instance runs on the open descriptors
    finally:
        channel.close()
    await asyncio.sleep(HOLD_S)


async def fill_shm(instance: Instance, session: aiohttp.ClientSession) -> None:
    """/dev/shm filled (ENOSPC for anyone creating or growing shared memory), then freed.

    NOTE: /dev/shm is RAM: where it may grow as large as the machine's memory (a tmpfs sized to RAM, as
    here), filling it would take the host down, so at most FILL_CAP is held. A running instance creates no
    shared memory; the start that meets a full /dev/shm is tests/test_startup_errors.py's."""
    path = Path(f"/dev/shm/mtpserve-soak-fill-{os.getpid()}")
    stats = os.statvfs("/dev/shm")
    fd = os.open(path, os.O_CREAT | os.O_WRONLY, 0o600)
    try:
        try:
            os.posix_fallocate(fd, 0, min(stats.f_bavail * stats.f_frsize, FILL_CAP))
        except OSError:
            pass  # NOTE: whatever fitted is held; the fault is that little or nothing is left
        await asyncio.sleep(HOLD_S)
    finally:
        os.close(fd)
        path.unlink()


async def idle_connections(instance: Instance, session: aiohttp.ClientSession, count: int = 1000) -> None:
    """Connections that say nothing, or half a request, and hold on."""
    host, port = instance.url.removeprefix("http://").split(":")
    held = []
    try:
        for i in range(count):
            sock = socket.socket()
            sock.setblocking(False)
            try:
                await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
                if i % 2:
                    sock.send(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n")
            except OSError:
                sock.close()
                continue
            held.append(sock)
        await asyncio.sleep(2 * HOLD_S)
    finally:
        for sock in held:
            sock.close()


def schedule(tensor_parallel: int) -> list[Fault]:
    ranks = [stop_process(f"rank{r}") for r in range(tensor_parallel)]
    return [stop_process("http"), *ranks, slow_reader, unlink_queue, fill_shm, idle_connections]
