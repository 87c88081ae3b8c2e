"""One instance's output channel: a queue (SysV or POSIX) plus a shared-memory ring, and its lifecycle.

Lifecycle:
  1. The owner (the process that outlives the engine: the HTTP process or the supervisor) calls
     OutputChannel.create(instance, transport). It first removes stale objects of a dead owner, then
     creates the ring and the queue exclusively with mode 0600 (fchmod after open: the umask does not
     matter), and records its pid and start time in the ring header.
  2. Engine rank 0 passes `channel.address` (or OutputChannel.attach(instance).address) to
     mtpserve.ops.OutputSender; the C++ op attaches to the existing objects, never creates them.
  3. The reader (mtpserve.ipc.output_reader) attaches by instance name.
  4. The owner calls remove() at exit: it marks the ring closed and removes the queue and the ring.

Transport choice: a frame that fits one queue message (8192 B on a stock kernel, header included)
goes inline. A larger one goes through the ring with the queue carrying only its 64-byte header (the
default), or as chunks of one message each (chunked=True). See docs/wire-format.md for the numbers.

Back-pressure policy (the C++ side implements it; ops_ext/output_channel.h): a send never blocks. A
frame that cannot go out (ring or queue full) waits, in order, in a bounded FIFO inside the engine
process; the op returns the number of pending frames and the engine pauses scheduling new steps while
it is non-zero, calling flush until it drains. Past the bound the op raises. Nothing is dropped.
"""

from __future__ import annotations

import os
import resource
import time
from dataclasses import dataclass
from pathlib import Path

import posix_ipc

from mtpserve.ipc import names, sysv, wire
from mtpserve.ipc.shm_ring import ShmRing

DEFAULT_RING_BYTES = 4 << 20  # ten frames of 256 requests x 9 tokens x top-20
STOCK_MSG_BYTES = 8192  # kernel.msgmax and fs.mqueue.msgsize_max on a stock kernel
STOCK_QUEUE_DEPTH = 10  # fs.mqueue.msg_max on a stock kernel


class ChannelBusyError(RuntimeError):
    """Another live process owns this instance's channel."""


class QueueBudgetError(OSError):
    """The kernel refused a POSIX queue: the user's RLIMIT_MSGQUEUE bytes are spent (or no fd is free)."""


@dataclass(frozen=True)
class ChannelAddress:
    """Everything a sender or a reader needs to find the channel's objects."""

    instance: str
    transport: wire.Transport
    ring_name: str
    queue_name: str  # POSIX transport
    sysv_key: int  # SysV transport; -1 for POSIX
    max_msg_bytes: int
    chunked: bool
    instance_tag: int


def process_start(pid: int) -> int | None:
    """The start time of pid in clock ticks since boot (/proc/<pid>/stat field 22), None if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return int(stat[stat.rindex(b")") + 2:].split()[19])


def owner_alive(ring: ShmRing) -> bool:
    pid = ring.get("owner_pid")
    return pid > 0 and process_start(pid) == ring.get("owner_start")


class OutputChannel:
    """The ring mapping plus the address; create() makes the objects, attach() finds them."""

    def __init__(self, address: ChannelAddress, ring: ShmRing, owner: bool) -> None:
        self.address = address
        self.ring = ring
        self.is_owner = owner

    @classmethod
    def create(cls, instance: str, transport: str | wire.Transport, *,
               ring_bytes: int = DEFAULT_RING_BYTES, max_msg_bytes: int = STOCK_MSG_BYTES,
               queue_depth: int = STOCK_QUEUE_DEPTH, chunked: bool = False) -> "OutputChannel":
        transport = _transport(transport)
        sweep_dead_instances()
        remove_stale(instance)
        ring = ShmRing.create(names.ring_name(instance), 0 if chunked else ring_bytes)
        try:
            key = _create_queue(instance, transport, max_msg_bytes, queue_depth)
        except BaseException:
            ring.close()
            ring.unlink()
            raise
        _write_ring_header(ring, instance, transport, key, max_msg_bytes, chunked)
        return cls(_address(instance, ring), ring, owner=True)

    @classmethod
    def attach(cls, instance: str) -> "OutputChannel":
        """Map an existing channel (reader, engine); raises posix_ipc.ExistentialError if absent."""
        ring = ShmRing.open(names.ring_name(instance))
        if not ring.is_valid():
            ring.close()
            raise RuntimeError(f"output ring of {instance!r} has no valid header")
        return cls(_address(instance, ring), ring, owner=False)

    def is_removed(self) -> bool:
        """True once the owner removed the channel (closed flag) or died, or the SysV queue is gone.

        NOTE: a POSIX queue whose name someone unlinked still works through every descriptor already
        open (the kernel frees it with the last one), so the instance keeps serving on it."""
        if self.ring.get("closed") or not owner_alive(self.ring):
            return True
        if self.address.transport is wire.Transport.SYSV:
            return sysv.find(self.address.sysv_key) is None
        return False

    def remove(self) -> None:
        """Mark closed, remove the queue and the ring (owner only), then unmap. Idempotent."""
        if not self.is_owner:
            raise PermissionError("only the creator removes the channel")
        if self.ring.is_closed:
            return
        self.ring.set("closed", 1)
        _remove_queue(self.address)
        self.ring.unlink()
        self.close()

    def close(self) -> None:
        if not self.ring.is_closed:
            self.ring.close()

    def __enter__(self) -> "OutputChannel":
        return self

    def __exit__(self, *exc: object) -> None:
        """The owner removes the channel, anyone else unmaps it."""
        self.remove() if self.is_owner else self.close()


def remove_stale(instance: str) -> list[str]:
    """Remove this instance's objects left by a dead owner; raise ChannelBusyError if it lives."""
    removed = []
    try:
        ring = ShmRing.open(names.ring_name(instance))
    except posix_ipc.ExistentialError:
        ring = None
    if ring is not None:
        if ring.is_valid() and owner_alive(ring):
            pid = ring.get("owner_pid")
            ring.close()
            raise ChannelBusyError(f"instance {instance!r} is running (pid {pid})")
        removed += _remove_ring_objects(instance, ring)
    removed += _remove_orphan_posix_queue(instance)
    return removed


def sweep_dead_instances(min_age_s: float = 60.0) -> list[str]:
    """Remove the channels of this user's instances whose owner died (SIGKILL, OOM): their POSIX queues
    would otherwise hold the user's RLIMIT_MSGQUEUE budget until reboot, under a name nobody starts again.
    A ring with no header yet may be one that a live launcher is creating: only an old one is removed."""
    removed: list[str] = []
    prefix = f"mtpserve.{os.getuid()}."
    for path in Path("/dev/shm").glob(f"{prefix}*.out"):
        instance = path.name[len(prefix):-len(".out")]
        try:
            ring = ShmRing.open("/" + path.name)
        except (OSError, posix_ipc.Error):
            continue
        complete, dead = ring.is_valid(), not owner_alive(ring)
        ring.close()
        if (complete and dead) or (not complete and _age_s(path) > min_age_s):
            try:
                removed += remove_stale(instance)
            except (ChannelBusyError, PermissionError, ValueError, OSError, posix_ipc.Error):
                continue
    return removed


def _age_s(path: Path) -> float:
    try:
        return time.time() - path.stat().st_mtime
    except OSError:
        return 0.0


def _transport(value: str | wire.Transport) -> wire.Transport:
    return value if isinstance(value, wire.Transport) else wire.Transport[value.upper()]


def _address(instance: str, ring: ShmRing) -> ChannelAddress:
    return ChannelAddress(
        instance=instance, transport=wire.Transport(ring.get("transport")),
        ring_name=ring.name, queue_name=names.queue_name(instance), sysv_key=ring.get("sysv_key"),
        max_msg_bytes=ring.get("max_msg_bytes"), chunked=bool(ring.get("chunked")),
        instance_tag=ring.get("instance_tag"))


def _write_ring_header(ring: ShmRing, instance: str, transport: wire.Transport, key: int,
                       max_msg_bytes: int, chunked: bool) -> None:
    pid = os.getpid()
    started = process_start(pid)
    assert started is not None, "our own process has a start time"
    for field, value in (("version", wire.RING_VERSION), ("transport", int(transport)),
                         ("owner_pid", pid), ("owner_start", started),
                         ("sysv_key", key), ("max_msg_bytes", max_msg_bytes),
                         ("instance_tag", names.instance_tag(instance)), ("chunked", int(chunked))):
        ring.set(field, value)
    ring.set("magic", wire.RING_MAGIC)  # last: a header with the magic is complete


def _create_queue(instance: str, transport: wire.Transport, max_msg_bytes: int, depth: int) -> int:
    if transport is wire.Transport.POSIX:
        try:
            mq = posix_ipc.MessageQueue(names.queue_name(instance), posix_ipc.O_CREX, mode=0o600,
                                        max_messages=depth, max_message_size=max_msg_bytes)
        except OSError as exc:  # posix_ipc says EMFILE, which Linux also returns for RLIMIT_MSGQUEUE
            raise QueueBudgetError(_budget_message(depth, max_msg_bytes, exc)) from exc
        os.fchmod(mq.mqd, 0o600)
        mq.close()
        return -1
    claimed = _live_sysv_keys()
    for attempt in range(names.MAX_KEY_ATTEMPTS):
        key = names.sysv_key(instance, attempt)
        if key not in claimed:
            _remove_orphan_sysv_queue(key)
        if sysv.create(key) is not None:
            return key
    raise RuntimeError(f"no free SysV key for instance {instance!r} in {names.MAX_KEY_ATTEMPTS} tries")


def _budget_message(depth: int, max_msg_bytes: int, exc: OSError) -> str:
    limit = resource.getrlimit(resource.RLIMIT_MSGQUEUE)[0]
    return (f"cannot create the POSIX output queue ({depth} x {max_msg_bytes} B): {exc}; the kernel counts "
            f"every queue of this user against RLIMIT_MSGQUEUE ({limit} B), so other queues hold it. "
            "Stop other instances, raise LimitMSGQUEUE= (systemd) or `ulimit -q`, "
            "or use --ipc-transport sysv")


def _live_sysv_keys() -> set[int]:
    """Keys recorded by this user's rings whose owner lives: never treated as orphans."""
    keys = set()
    for path in Path("/dev/shm").glob(f"mtpserve.{os.getuid()}.*.out"):
        try:
            ring = ShmRing.open("/" + path.name)
        except (OSError, posix_ipc.Error):
            continue
        if ring.is_valid() and owner_alive(ring):
            keys.add(ring.get("sysv_key"))
        ring.close()
    return keys


def _remove_orphan_sysv_queue(key: int) -> None:
    """Remove a queue at one of our keys left by a crash: ours, claimed by no live ring, and no live
    process sent or received on it."""
    qid = sysv.find(key)
    if qid is None or sysv.owner_uid(qid) != os.getuid():
        return
    if not any(pid > 0 and process_start(pid) is not None for pid in sysv.last_pids(qid)):
        sysv.remove(qid)


def _remove_queue(address: ChannelAddress) -> None:
    if address.transport is wire.Transport.SYSV:
        qid = sysv.find(address.sysv_key)
        if qid is not None:
            sysv.remove(qid)
        return
    try:
        posix_ipc.unlink_message_queue(address.queue_name)
    except posix_ipc.ExistentialError:
        pass


def _remove_ring_objects(instance: str, ring: ShmRing) -> list[str]:
    removed = [ring.name]
    if ring.is_valid() and ring.get("transport") == wire.Transport.SYSV:
        qid = sysv.find(ring.get("sysv_key"))
        if qid is not None and sysv.owner_uid(qid) == os.getuid():
            sysv.remove(qid)
            removed.append(f"sysv:{ring.get('sysv_key')}")
    ring.close()
    ring.unlink()
    return removed


def _remove_orphan_posix_queue(instance: str) -> list[str]:
    name = names.queue_name(instance)
    try:
        mq = posix_ipc.MessageQueue(name)
    except posix_ipc.ExistentialError:
        return []
    ours = os.fstat(mq.mqd).st_uid == os.getuid()
    mq.close()
    if not ours:
        raise PermissionError(f"{name} belongs to another user")
    posix_ipc.unlink_message_queue(name)
    return [f"mq:{name}"]
