"""Rank 0 -> ranks >= 1: each step's plan, over a TCP connection per follower, outside the collectives.

Followers wait for the next plan in a blocking socket read, which has no timeout: an instance may sit
idle for as long as nobody calls it. (Waiting inside a collective did have one: gloo gave up after about
30 s, and NCCL's watchdog would do the same on a GPU host.) The device collectives of a step (the model's
all-reduces and all-gathers) start only once every rank has its plan, so none of them waits for work.

1. Rank 0 listens on `tp.plan_endpoint` (the rendezvous host, a port above the rendezvous ports:
   engine/tp_env.py) and accepts one connection per follower; each follower says its rank first.
2. Per step, on the device thread, just before the forward: rank 0 writes an 8-byte little-endian
   length and the msgpack plan to every follower, in launch order. TCP keeps that order, so every rank
   runs the same plans in the same order. Length -1 is the stop plan.
3. A follower whose rank 0 died reads EOF and fails (the instance goes down, as before). Rank 0 whose
   follower died fails the send, or the step's collective stalls until `engine.step_timeout`.
Works across hosts: it is plain TCP to the rendezvous host.
"""

from __future__ import annotations

import socket
import struct
import time

from mtpserve.engine.step_plan import StepPlan
from mtpserve.engine.tp_plan_codec import decode_plan, encode_plan
from mtpserve.model.parallel import TensorParallel

STOP = -1  # header value: no more steps, the followers return
_HEADER = struct.Struct("<q")
CONNECT_TIMEOUT_S = 600.0  # ranks load the model before they meet here


class PlanChannel:
    def __init__(self, tp: TensorParallel, connect_timeout_s: float = CONNECT_TIMEOUT_S) -> None:
        self.tp = tp
        self.comm_seconds = 0.0  # time spent sending or waiting for plans
        self.num_plans = 0
        self.num_bytes = 0
        host, _, port = tp.plan_endpoint.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"no plan endpoint for rank {tp.rank} (got {tp.plan_endpoint!r})")
        self._followers: list[socket.socket] = []
        self._leader: socket.socket | None = None
        if tp.rank == 0:
            self._followers = _accept_followers(host, int(port), tp.size - 1, connect_timeout_s)
        else:
            self._leader = _connect(host, int(port), tp.rank, connect_timeout_s)

    def send(self, plan: StepPlan | None) -> None:
        """Rank 0: send `plan` to every follower (None: the stop plan)."""
        payload = b"" if plan is None else encode_plan(plan)
        start = time.perf_counter()
        message = _HEADER.pack(len(payload) if plan is not None else STOP) + payload
        for follower in self._followers:
            follower.sendall(message)
        self._count(start, len(payload))

    def recv(self) -> StepPlan | None:
        """Ranks >= 1: the next plan (waiting as long as it takes), or None after the stop plan."""
        assert self._leader is not None, "only followers receive plans"
        (n,) = _HEADER.unpack(_read(self._leader, _HEADER.size))
        if n == STOP:
            return None
        start = time.perf_counter()
        payload = _read(self._leader, n)
        self._count(start, n)
        return decode_plan(payload)

    def close(self) -> None:
        for sock in [*self._followers, *([self._leader] if self._leader else [])]:
            sock.close()

    def _count(self, start: float, n: int) -> None:
        self.comm_seconds += time.perf_counter() - start
        self.num_plans += 1
        self.num_bytes += n


def _accept_followers(host: str, port: int, count: int, timeout_s: float) -> list[socket.socket]:
    with socket.create_server((host, port)) as server:
        server.settimeout(timeout_s)
        by_rank: dict[int, socket.socket] = {}
        while len(by_rank) < count:
            conn, _ = server.accept()
            conn.settimeout(None)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            (rank,) = _HEADER.unpack(_read(conn, _HEADER.size))
            by_rank[rank] = conn
    return [by_rank[r] for r in sorted(by_rank)]


def _connect(host: str, port: int, rank: int, timeout_s: float) -> socket.socket:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=5.0)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)  # NOTE: rank 0 may still be loading the model
    sock.settimeout(None)  # NOTE: a plan may be an idle hour away
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.sendall(_HEADER.pack(rank))
    return sock


def _read(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("rank 0 closed the plan channel")
        buf += chunk
    return bytes(buf)
