"""A second user account cannot open an instance's queue or ring (they are 0600, owned by us).

Needs root to create the account (useradd); skipped with the reason otherwise. The probe runs as that
user under the system Python with ctypes only, since the project's venv may not be readable to it.
"""

import json
import os
import pwd
import shutil
import subprocess

import pytest

from mtpserve.ipc import wire

OTHER = "mtpserve-ipc-probe"
PROBE = r"""
import ctypes, ctypes.util, json, os, sys
libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
rt = ctypes.CDLL(ctypes.util.find_library("rt"), use_errno=True)
ring, queue, key = sys.argv[1], sys.argv[2], int(sys.argv[3])
out = {}
try:
    os.open("/dev/shm" + ring, os.O_RDWR); out["ring"] = "opened"
except OSError as e:
    out["ring"] = e.errno
fd = rt.mq_open(queue.encode(), os.O_RDONLY | os.O_NONBLOCK)
out["mq"] = "opened" if fd >= 0 else ctypes.get_errno()
if key >= 0:  # msgget(key, 0) asks for no access; reading and writing are what must fail
    qid = libc.msgget(key, 0)
    buf = ctypes.create_string_buffer(b"\x01" + bytes(63))  # mtype 1
    out["sysv_send"] = "sent" if libc.msgsnd(qid, buf, 8, 0o4000) == 0 else ctypes.get_errno()
    got = libc.msgrcv(qid, buf, 8, 0, 0o4000)
    out["sysv_recv"] = "received" if got >= 0 else ctypes.get_errno()
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def other_user():
    if os.geteuid() != 0 or shutil.which("useradd") is None:
        pytest.skip("creating a second user needs root and useradd")
    created = False
    try:
        pwd.getpwnam(OTHER)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin",
                        OTHER], check=True)
        created = True
    entry = pwd.getpwnam(OTHER)
    yield entry.pw_uid, entry.pw_gid
    if created:
        subprocess.run(["userdel", OTHER], check=False)


def run_as(uid: int, gid: int, *args: str) -> dict:
    def drop() -> None:
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)

    done = subprocess.run(["/usr/bin/python3", "-c", PROBE, *args], capture_output=True, text=True,
                          preexec_fn=drop, check=True, cwd="/")
    return json.loads(done.stdout)


@pytest.mark.parametrize("transport", ["posix", "sysv"])
def test_another_user_cannot_open_the_channel(make_channel, other_user, transport):
    ch = make_channel(transport)
    a = ch.address
    got = run_as(*other_user, a.ring_name, a.queue_name, str(a.sysv_key))
    assert got["ring"] == 13  # EACCES
    if a.transport is wire.Transport.POSIX:
        assert got["mq"] == 13
    else:
        assert got["sysv_send"] == 13 and got["sysv_recv"] == 13
