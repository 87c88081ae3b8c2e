"""The shared-memory ring of an output channel: a header page, then `capacity` data bytes.

The C++ writer copies a frame's payload to `ring_pos % capacity` (never wrapping inside a frame; it
skips the tail instead) and sends the header through the queue. The reader copies the payload out,
then publishes `read_pos = ring_pos + len`, which frees everything before it. Positions are monotonic
byte counts, so `write_pos - read_pos` is the space in use. NOTE: read_pos is one aligned 8-byte
store from NumPy; on x86-64 and AArch64 it is atomic, and the copy out happens before it.
"""

from __future__ import annotations

import mmap
import os

import numpy as np
import posix_ipc

from mtpserve.ipc import wire


# NOTE: populate at map time. A first write to a tmpfs page costs a fault (~µs per 4 KiB page),
# which on a ring that has not wrapped yet would be paid on every frame.
_MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)


_WRITE = wire.field_offset(wire.RING_DTYPE, "write_pos") // 8
_READ = wire.field_offset(wire.RING_DTYPE, "read_pos") // 8


class RingError(ValueError):
    """A ring descriptor points outside the ring or behind what was already released."""


class ShmRing:
    """A mapping of the ring object; create() for the owner, open() for the reader and the cleaner."""

    def __init__(self, name: str, mm: mmap.mmap) -> None:
        self.name = name
        self._mm = mm
        self._header = np.frombuffer(mm, wire.RING_DTYPE, count=1)
        self._words = memoryview(mm)[:wire.RING_DTYPE.itemsize].cast("Q")  # u64 positions, fast
        self.capacity = int(self._header["capacity"][0])
        self._data = np.frombuffer(mm, np.uint8, count=self.capacity, offset=wire.RING_HEADER_BYTES)

    @classmethod
    def create(cls, name: str, capacity: int) -> "ShmRing":
        """Create the object exclusively, 0600 whatever the umask; raises ExistentialError if present."""
        shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600,
                                     size=wire.RING_HEADER_BYTES + capacity)
        try:
            os.fchmod(shm.fd, 0o600)
            # NOTE: reserve the pages now: a full /dev/shm is ENOSPC here, not SIGBUS at a later write
            os.posix_fallocate(shm.fd, 0, shm.size)
            mm = mmap.mmap(shm.fd, shm.size, flags=_MAP_FLAGS)
        except BaseException:
            shm.unlink()
            raise
        finally:
            shm.close_fd()
        np.frombuffer(mm, wire.RING_DTYPE, count=1)["capacity"] = capacity
        return cls(name, mm)

    @classmethod
    def open(cls, name: str) -> "ShmRing":
        shm = posix_ipc.SharedMemory(name)
        try:
            if os.fstat(shm.fd).st_uid != os.getuid():
                raise PermissionError(f"{name} belongs to another user")
            mm = mmap.mmap(shm.fd, shm.size, flags=_MAP_FLAGS)
        finally:
            shm.close_fd()
        return cls(name, mm)

    def get(self, field: str) -> int:
        return int(self._header[field][0])

    def set(self, field: str, value: int) -> None:
        self._header[field] = value

    def is_valid(self) -> bool:
        return self.get("magic") == wire.RING_MAGIC and self.get("version") == wire.RING_VERSION

    def take(self, pos: int, size: int) -> bytes:
        """Copy out the payload at ring position pos (validated against the positions)."""
        offset = pos % self.capacity if self.capacity else 0
        if size > self.capacity or offset + size > self.capacity:
            raise RingError("payload crosses the end of the ring")
        if pos < self._words[_READ] or pos + size > self._words[_WRITE]:
            raise RingError("payload outside the written, unreleased span")
        return self._data[offset:offset + size].tobytes()

    def release(self, end: int) -> None:
        """Free the ring up to byte position end (monotonic: never moves back)."""
        if end > self._words[_READ]:
            self._words[_READ] = end

    @property
    def is_closed(self) -> bool:
        return self._mm.closed

    def close(self) -> None:
        self._words.release()
        del self._header, self._data, self._words
        self._mm.close()

    def unlink(self) -> None:
        try:
            posix_ipc.unlink_shared_memory(self.name)
        except posix_ipc.ExistentialError:
            pass
