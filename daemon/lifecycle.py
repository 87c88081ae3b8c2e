"""How a child process ends: with its parent (no orphans when the launcher is SIGKILLed), or at once."""

from __future__ import annotations

import asyncio
import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1
PARENT_POLL_S = 1.0


def die_with_parent() -> int:
    """Ask the kernel for SIGTERM when the parent dies; returns the parent pid to watch as a backstop.

    NOTE: PDEATHSIG fires when the parent *thread* exits, and is lost if the parent died before the call,
    hence the pid check right after and the watcher below.
    """
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGTERM)
    return parent


async def watch_parent(parent: int, on_orphaned) -> None:
    """Call `on_orphaned()` once the parent is gone (re-parented to init or a subreaper)."""
    while os.getppid() == parent:
        await asyncio.sleep(PARENT_POLL_S)
    on_orphaned()


def exit_now(status: int) -> None:
    """Exit without joining threads or running Paddle's teardown (either may wait on a stuck peer)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
