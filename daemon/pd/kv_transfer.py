"""KVTransferAgent: a rank's Mooncake transfer engine, its registered KV memory, one-sided reads.

Threads:
  - `start` and `close`: the thread that owns the KV tensors (the rank's main thread), once each.
  - `read`: a transfer worker thread. Mooncake releases the GIL for the whole call, so the rank loop
    keeps stepping, but the calling thread polls for completion (in `bench kv` it burns about 0.3-0.45
    CPU seconds per second of transfer). Concurrent `read`s are allowed (each is its own batch).
  - `session`: any thread.
The prefill side only starts (and later closes) an agent: the decode side's reads need nothing from
the prefill's Python code.

Process-wide Mooncake knobs are environment variables read when the library loads or the engine is
built, so the launcher puts `mooncake_environment(...)` into the rank's environment.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from mooncake.engine import TransferEngine

P2P_HANDSHAKE = "P2PHANDSHAKE"  # peers exchange metadata directly; no etcd / metadata server
# NOTE: Mooncake's TCP transport queues at most 2048 transfers per peer (MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER)
# and fails a batch that overflows it; a read is submitted in batches of at most this many descriptors.
MAX_BATCH = 1024


class KVTransferError(RuntimeError):
    """A Mooncake call failed: peer gone or unreachable, address outside its registered memory, timeout."""


def mooncake_environment(transfer_timeout_s: int = 5, log_level: str = "ERROR") -> dict[str, str]:
    """Environment for a rank process that runs an agent.

    transfer_timeout_s: a batch fails when it takes longer than this plus 1 s per GiB (Mooncake's
      minimum is 5; the TCP transport's stall detectors get the same bound). The FIRST contact with a peer that
      accepts connections but never answers (a stopped process) is bounded by Mooncake's fixed 60 s
      handshake receive timeout, which has no knob.
    log_level: Mooncake's glog threshold (INFO, WARNING, ERROR); INFO logs a dozen lines per engine.
    """
    seconds = str(max(5, transfer_timeout_s))
    return {"MC_TRANSFER_TIMEOUT": seconds, "MC_TCP_PROGRESS_TIMEOUT_SEC": seconds,
            "MC_TCP_STATUS_TIMEOUT_SEC": seconds, "MC_LOG_LEVEL": log_level,
            "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": "8192"}  # NOTE: room for 8 concurrent batches


class KVTransferAgent:
    """One Mooncake TransferEngine with the rank's KV buffers registered (docs/pd.md).

    1. `start` initializes the engine (P2P handshake, no metadata server) and registers every buffer.
    2. The rank publishes `session` ("host:rpc_port") and its KVLayout (pd.kv_layout.layout_of).
    3. A decode rank calls `read` with descriptors from pd.kv_layout.read_descriptors.
    4. `close` unregisters the buffers; the tensors must stay alive until then.
    """

    def __init__(self, engine: TransferEngine, session: str) -> None:
        self._engine: TransferEngine | None = engine
        self._session = session
        self._regions: list[tuple[int, int]] = []

    @classmethod
    def start(cls, hostname: str, protocol: str, buffers: Sequence[tuple[int, int]],
              device_name: str = "") -> KVTransferAgent:
        """hostname: the address peers reach this rank at; protocol: "tcp" or "rdma";
        buffers: (address, bytes) of each KV buffer (pd.kv_layout.regions_of); device_name: RDMA NICs
        to use, comma separated ("" = all)."""
        from mooncake.engine import TransferEngine  # NOTE: here, so ranks without PD never load it

        engine = TransferEngine()
        if engine.initialize(hostname, P2P_HANDSHAKE, protocol, device_name) != 0:
            raise KVTransferError(f"Mooncake initialize failed (host {hostname!r}, protocol {protocol!r})")
        agent = cls(engine, f"{hostname}:{engine.get_rpc_port()}")
        for addr, length in buffers:
            agent._register(addr, length)
        return agent

    def _register(self, addr: int, length: int) -> None:
        assert self._engine is not None, "registering into a closed agent"
        if self._engine.register_memory(addr, length) != 0:
            self.close()
            raise KVTransferError(f"Mooncake register_memory failed for {length} bytes at {addr:#x}")
        self._regions.append((addr, length))

    @property
    def session(self) -> str:
        return self._session

    def read(self, remote_session: str, local_addrs: list[int], remote_addrs: list[int],
             lengths: list[int]) -> int:
        """Copy remote_addrs[i] .. +lengths[i] of `remote_session` into local_addrs[i]; bytes read.

        Blocks until every copy is done or one failed (KVTransferError); see the module docstring
        for the thread it belongs on."""
        if not (len(local_addrs) == len(remote_addrs) == len(lengths)):
            raise ValueError("local_addrs, remote_addrs and lengths differ in length")
        if self._engine is None:
            raise KVTransferError("the agent is closed")
        for lo in range(0, len(lengths), MAX_BATCH):
            hi = lo + MAX_BATCH
            if self._engine.batch_transfer_sync_read(remote_session, local_addrs[lo:hi], remote_addrs[lo:hi],
                                                     lengths[lo:hi]) != 0:
                raise KVTransferError(f"KV read of ranges {lo}..{min(hi, len(lengths)) - 1} of {len(lengths)} "
                                      f"from {remote_session} failed")
        return sum(lengths)

    def close(self) -> None:
        """Unregister the KV memory and stop the engine (its listeners). Idempotent; no `read` may
        be running."""
        if self._engine is None:
            return
        for addr, _ in self._regions:
            self._engine.unregister_memory(addr)
        self._regions.clear()
        self._engine = None  # NOTE: the last reference: the engine's destructor stops its threads
