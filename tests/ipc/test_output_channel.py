"""Channel lifecycle: 0600 objects whatever the umask, stale objects of a dead owner removed at the
next start, a live owner refused, everything removed at exit, foreign SysV keys skipped."""

import os
import subprocess
import sys
import uuid

import posix_ipc
import pytest

from mtpserve.ipc import names, sysv, wire
from mtpserve.ipc.output_channel import ChannelBusyError, OutputChannel, remove_stale

TRANSPORTS = ["posix", "sysv"]


def object_modes(ch: OutputChannel) -> list[int]:
    modes = [os.stat(f"/dev/shm{ch.address.ring_name}").st_mode & 0o777]
    if ch.address.transport is wire.Transport.SYSV:
        return modes + [sysv.mode(sysv.open_existing(ch.address.sysv_key))]
    mq = posix_ipc.MessageQueue(ch.address.queue_name)
    try:
        return modes + [os.fstat(mq.mqd).st_mode & 0o777]
    finally:
        mq.close()


def gone(address) -> bool:
    if os.path.exists(f"/dev/shm{address.ring_name}"):
        return False
    if address.transport is wire.Transport.SYSV:
        return sysv.find(address.sysv_key) is None
    try:
        posix_ipc.MessageQueue(address.queue_name).close()
    except posix_ipc.ExistentialError:
        return True
    return False


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("umask", [0o000, 0o277])
def test_objects_are_0600_whatever_the_umask(make_channel, transport, umask):
    old = os.umask(umask)
    try:
        ch = make_channel(transport)
    finally:
        os.umask(old)
    assert object_modes(ch) == [0o600, 0o600]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_attach_sees_the_creators_address(make_channel, instance, transport):
    ch = make_channel(transport, ring_bytes=1 << 16)
    other = OutputChannel.attach(instance)
    assert other.address == ch.address and other.ring.capacity == 1 << 16
    other.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_remove_leaves_nothing_and_readers_see_it(instance, transport):
    ch = OutputChannel.create(instance, transport)
    reader_view = OutputChannel.attach(instance)
    assert not reader_view.is_removed()
    ch.remove()
    assert reader_view.is_removed() and gone(ch.address)
    reader_view.close()


def test_a_live_owner_is_refused(make_channel, instance):
    make_channel("posix")
    with pytest.raises(ChannelBusyError):
        OutputChannel.create(instance, "sysv")


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_stale_objects_of_a_killed_owner_are_removed_at_the_next_start(make_channel, instance,
                                                                       transport):
    script = ("import os, signal; from mtpserve.ipc.output_channel import OutputChannel;"
              f"c = OutputChannel.create({instance!r}, {transport!r});"
              "print(c.address.sysv_key, flush=True); os.kill(os.getpid(), signal.SIGKILL)")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == -9
    stale = OutputChannel.attach(instance)
    assert not gone(stale.address) and stale.is_removed()  # the dead owner left everything behind
    stale.close()
    ch = make_channel(transport)
    assert ch.ring.get("owner_pid") == os.getpid()
    if transport == "sysv":
        old_key = int(done.stdout.split()[0])
        assert ch.address.sysv_key == old_key  # the key was freed, not skipped


def test_remove_stale_reports_what_it_removed(instance):
    script = ("import os, signal; from mtpserve.ipc.output_channel import OutputChannel;"
              f"OutputChannel.create({instance!r}, 'sysv'); os.kill(os.getpid(), signal.SIGKILL)")
    subprocess.run([sys.executable, "-c", script])
    removed = remove_stale(instance)
    assert removed[0] == names.ring_name(instance) and removed[1].startswith("sysv:")
    assert remove_stale(instance) == []


def test_a_key_held_by_a_live_foreign_queue_is_skipped(make_channel, instance):
    key0 = names.sysv_key(instance, 0)
    qid = sysv.create(key0)
    assert qid is not None
    try:
        assert sysv.send(qid, b"x")  # a live process (this one) used it: not an orphan
        ch = make_channel("sysv")
        assert ch.address.sysv_key == names.sysv_key(instance, 1)
    finally:
        sysv.remove(qid)


def test_keys_do_not_collide_like_ftok():
    """Instances whose numbers share the low 8 bits (ftok's weakness) get different keys."""
    keys = {names.sysv_key(str(port), 0) for port in range(8000, 8000 + 256 * 8, 256)}
    assert len(keys) == 8


def test_instance_names_are_checked():
    with pytest.raises(ValueError):
        names.ring_name("../etc")


def test_channel_uses_stock_kernel_limits(make_channel):
    """10 messages of 8192 B (POSIX) and the default 16 KiB SysV queue: nothing needs root."""
    ch = make_channel("posix")
    mq = posix_ipc.MessageQueue(ch.address.queue_name)
    try:
        assert (mq.max_messages, mq.max_message_size) == (10, 8192)
    finally:
        mq.close()


def test_a_live_instance_queue_is_never_taken_for_an_orphan(make_channel, instance, monkeypatch):
    """Even if two instances' keys collided, the one claimed by a live ring is skipped, not removed."""
    live = make_channel("sysv")
    other = instance + "-b"
    monkeypatch.setattr(names, "sysv_key",
                        lambda inst, attempt, uid=None: live.address.sysv_key if attempt == 0 else
                        0x10000 + hash((inst, attempt)) % 0x7FFF0000)
    second = OutputChannel.create(other, "sysv")
    try:
        assert second.address.sysv_key != live.address.sysv_key
        assert sysv.find(live.address.sysv_key) is not None
    finally:
        second.remove()


def kill_an_owner(instance: str, transport: str) -> None:
    script = ("import os, signal; from mtpserve.ipc.output_channel import OutputChannel;"
              f"OutputChannel.create({instance!r}, {transport!r}); os.kill(os.getpid(), signal.SIGKILL)")
    assert subprocess.run([sys.executable, "-c", script]).returncode == -9


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_any_start_removes_the_channels_of_dead_instances_and_keeps_live_ones(make_channel, transport):
    """A SIGKILLed instance's POSIX queue holds the user's RLIMIT_MSGQUEUE bytes until someone unlinks it,
    and nobody may ever start that instance name again: the next start of any instance sweeps it."""
    dead, live = (f"t{os.getpid()}-{uuid.uuid4().hex[:8]}" for _ in range(2))
    kill_an_owner(dead, transport)
    stale = OutputChannel.attach(dead)
    keeper = OutputChannel.create(live, transport)
    try:
        assert stale.is_removed() and gone(stale.address)
        assert not OutputChannel.attach(live).is_removed()
        make_channel(transport)  # a third start leaves the live one alone
        assert not keeper.is_removed()
    finally:
        stale.close()
        keeper.remove()


def test_a_spent_queue_budget_is_named_with_its_fix(instance):
    """Linux answers EMFILE when the user's queues exceed RLIMIT_MSGQUEUE; the error says so."""
    script = ("import resource; from mtpserve.ipc.output_channel import OutputChannel, QueueBudgetError;"
              "resource.setrlimit(resource.RLIMIT_MSGQUEUE, (1024, resource.getrlimit("
              "resource.RLIMIT_MSGQUEUE)[1]))\n"
              f"try:\n    OutputChannel.create({instance!r}, 'posix')\n"
              "except QueueBudgetError as exc:\n    print(exc)")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert "RLIMIT_MSGQUEUE (1024 B)" in done.stdout and "--ipc-transport sysv" in done.stdout
    assert remove_stale(instance) == []  # the ring made before the queue went with the failure
