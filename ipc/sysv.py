"""SysV message queues through ctypes (libc): the calls release the GIL while they block."""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
from typing import NoReturn

IPC_CREAT = 0o1000
IPC_EXCL = 0o2000
IPC_NOWAIT = 0o4000
IPC_RMID = 0
IPC_STAT = 2
_MTYPE = ctypes.sizeof(ctypes.c_long)
# struct msqid_ds offsets on 64-bit Linux (glibc): msg_perm.uid, msg_qnum, msg_lspid, msg_lrpid
_UID_OFFSET, _MODE_OFFSET, _LSPID_OFFSET, _LRPID_OFFSET = 4, 20, 96, 100

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.msgget.argtypes = [ctypes.c_int, ctypes.c_int]
_libc.msgget.restype = ctypes.c_int
_libc.msgsnd.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.msgsnd.restype = ctypes.c_int
_libc.msgrcv.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_long, ctypes.c_int]
_libc.msgrcv.restype = ctypes.c_ssize_t
_libc.msgctl.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
_libc.msgctl.restype = ctypes.c_int


def _raise(what: str) -> NoReturn:
    err = ctypes.get_errno()
    raise OSError(err, f"{what}: {os.strerror(err)}")


def create(key: int, mode: int = 0o600) -> int | None:
    """Create a new queue for key; None when the key is taken."""
    qid = _libc.msgget(key, IPC_CREAT | IPC_EXCL | mode)
    if qid >= 0:
        return qid
    if ctypes.get_errno() == errno.EEXIST:
        return None
    _raise("msgget")


def open_existing(key: int) -> int:
    qid = _libc.msgget(key, 0)
    if qid < 0:
        _raise("msgget")
    return qid


def find(key: int) -> int | None:
    """The queue id of key, or None when no queue has it."""
    qid = _libc.msgget(key, 0)
    return qid if qid >= 0 else None


def _stat(qid: int) -> bytes:
    buf = ctypes.create_string_buffer(512)  # larger than struct msqid_ds
    if _libc.msgctl(qid, IPC_STAT, buf) != 0:
        _raise("msgctl IPC_STAT")
    return buf.raw


def _u32(raw: bytes, offset: int) -> int:
    return int.from_bytes(raw[offset:offset + 4], "little")


def owner_uid(qid: int) -> int:
    return _u32(_stat(qid), _UID_OFFSET)


def mode(qid: int) -> int:
    """Permission bits of the queue."""
    return _u32(_stat(qid), _MODE_OFFSET) & 0o777


def last_pids(qid: int) -> tuple[int, int]:
    """(last sender pid, last receiver pid); 0 when nobody sent / received yet."""
    raw = _stat(qid)
    return _u32(raw, _LSPID_OFFSET), _u32(raw, _LRPID_OFFSET)


def remove(qid: int) -> None:
    if _libc.msgctl(qid, IPC_RMID, None) != 0 and ctypes.get_errno() not in (errno.EINVAL, errno.EIDRM):
        _raise("msgctl IPC_RMID")


def send(qid: int, data: bytes, mtype: int = 1, nowait: bool = True) -> bool:
    """Send one message; False when the queue is full and nowait is set."""
    buf = ctypes.create_string_buffer(_MTYPE + len(data))
    ctypes.memmove(buf, mtype.to_bytes(_MTYPE, "little"), _MTYPE)
    ctypes.memmove(ctypes.addressof(buf) + _MTYPE, data, len(data))
    if _libc.msgsnd(qid, buf, len(data), IPC_NOWAIT if nowait else 0) == 0:
        return True
    if ctypes.get_errno() == errno.EAGAIN:
        return False
    _raise("msgsnd")


class Receiver:
    """A reusable receive buffer; recv() blocks in msgrcv with the GIL released."""

    def __init__(self, qid: int, max_bytes: int) -> None:
        self.qid = qid
        self.max_bytes = max_bytes
        self._buf = ctypes.create_string_buffer(_MTYPE + max_bytes)
        self._addr = ctypes.addressof(self._buf)

    def recv(self, nowait: bool = False) -> tuple[int, bytes] | None:
        """(mtype, body); None when nowait and the queue is empty. Raises OSError (EIDRM: removed)."""
        while True:
            n = _libc.msgrcv(self.qid, self._buf, self.max_bytes, 0, IPC_NOWAIT if nowait else 0)
            if n >= 0:
                mtype = int.from_bytes(ctypes.string_at(self._addr, _MTYPE), "little")
                return mtype, ctypes.string_at(self._addr + _MTYPE, n)
            err = ctypes.get_errno()
            if err == errno.EINTR:
                continue
            if nowait and err == errno.ENOMSG:
                return None
            _raise("msgrcv")
