"""Names and keys of one instance's IPC objects, derived from the instance name and the user id.

Never from the working directory and never through ftok (which keeps 8 bits of the id): a 64-bit
BLAKE2 hash of (uid, instance, object, attempt) gives the SysV key, and POSIX names spell the uid and
the instance out. A SysV key that is taken by a foreign queue is skipped (the next attempt's key).
"""

from __future__ import annotations

import hashlib
import os
import re

_INSTANCE = re.compile(r"^[A-Za-z0-9_-]{1,48}$")
MAX_KEY_ATTEMPTS = 16


def check_instance(instance: str) -> str:
    if not _INSTANCE.match(instance):
        raise ValueError(f"instance name {instance!r} must match {_INSTANCE.pattern}")
    return instance


def _hash64(*parts: object) -> int:
    text = ":".join(str(p) for p in ("mtpserve", *parts)).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")


def ring_name(instance: str, uid: int | None = None) -> str:
    """POSIX shared-memory name of the output ring (also the channel's identity)."""
    return f"/mtpserve.{os.getuid() if uid is None else uid}.{check_instance(instance)}.out"


def queue_name(instance: str, uid: int | None = None) -> str:
    """POSIX message-queue name of the output channel (its own namespace, so the same spelling)."""
    return ring_name(instance, uid)


def sysv_key(instance: str, attempt: int, uid: int | None = None) -> int:
    """The attempt-th candidate SysV key: positive, 31 bits, never IPC_PRIVATE (0)."""
    key = _hash64(os.getuid() if uid is None else uid, check_instance(instance), "out", attempt)
    return (key & 0x7FFFFFFF) or 1


def instance_tag(instance: str, uid: int | None = None) -> int:
    """32-bit tag every frame carries; a frame with another tag is rejected."""
    return _hash64(os.getuid() if uid is None else uid, check_instance(instance)) & 0xFFFFFFFF
