"""KV blocks cross processes through Mooncake (TCP): a real peer process holds the 'prefill' KV."""

from __future__ import annotations

import concurrent.futures
import os
import dataclasses
import socket
import subprocess
import sys
from pathlib import Path

import msgspec
import numpy as np
import pytest

from kv_peer import PeerSpec, allocate, block_values
from mtpserve.ipc import request_channel as rc
from mtpserve.pd.kv_layout import kv_buffers, layout_of, read_descriptors, regions_of
from mtpserve.pd.kv_transfer import KVTransferAgent, KVTransferError, mooncake_environment

PEER = Path(__file__).with_name("kv_peer.py")
SPEC = PeerSpec(layers=3, depths=2, num_blocks=24, block_size=4, kv_heads=2, head_dim=8,
                fill_blocks=[2, 3, 4, 7, 9, 10, 11, 15, 20], seed=11)
NO_HANG_S = 20.0  # a failed read must come back, not hang: far above Mooncake's 5 s stall bound


@dataclasses.dataclass
class Peer:
    proc: subprocess.Popen
    session: str
    layout: rc.KVLayout

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)


def start_peer(spec: PeerSpec) -> Peer:
    env = {**os.environ, **mooncake_environment()}
    proc = subprocess.Popen([sys.executable, str(PEER), msgspec.json.encode(spec).decode()], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        proc.kill()
        raise RuntimeError(f"kv_peer exited with {proc.wait()}")
    hello = msgspec.json.decode(line, type=dict[str, msgspec.Raw])
    layout = msgspec.json.decode(hello["layout"], type=rc.KVLayout)
    return Peer(proc, msgspec.json.decode(hello["session"]), layout)


@pytest.fixture(scope="module")
def peer():
    p = start_peer(SPEC)
    yield p
    p.stop()


@pytest.fixture(scope="module")
def local():
    """The 'decode' rank: its own KV (more blocks, so other addresses and ids) and agent."""
    main_kv, depths = allocate(dataclasses.replace(SPEC, num_blocks=40))
    buffers = kv_buffers(main_kv, depths)
    agent = KVTransferAgent.start("127.0.0.1", "tcp", regions_of(buffers))
    yield buffers, layout_of(buffers, SPEC.block_size), agent
    agent.close()


def rows(buffer, block: int) -> np.ndarray:
    bs = SPEC.block_size
    return buffer.numpy()[block * bs:(block + 1) * bs]


def test_read_copies_remote_blocks_into_other_local_blocks(peer, local):
    buffers, layout, agent = local
    remote_blocks = [3, 4, 9, 10, 11, 2, 20, 7]  # runs, a backwards jump, singletons
    local_blocks = [30, 31, 5, 6, 8, 0, 1, 12]  # 3->30 4->31 run; 9,10 -> 5,6 run; 11 -> 8 breaks it
    desc = read_descriptors(layout, local_blocks, peer.layout, remote_blocks)
    assert len(desc.lengths) < len(buffers) * len(remote_blocks)  # something coalesced
    n = agent.read(peer.session, *desc)
    assert n == len(remote_blocks) * sum(layout.block_bytes)
    shape = (SPEC.block_size, SPEC.kv_heads, SPEC.head_dim)
    for i, buffer in enumerate(buffers):
        for lb, rb in zip(local_blocks, remote_blocks):
            np.testing.assert_array_equal(rows(buffer, lb), block_values(SPEC.seed, i, rb, *shape))
        for lb in sorted(set(range(41)) - set(local_blocks)):  # 40 blocks + the scratch block
            assert not rows(buffer, lb).any(), f"buffer {i} block {lb} was touched"


def test_reads_from_two_threads_at_once(peer, local):
    """The decode rank may run transfers for two requests concurrently."""
    buffers, layout, agent = local
    jobs = [([16, 17], [9, 10]), ([18, 19, 22], [15, 20, 2])]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        done = [pool.submit(agent.read, peer.session, *read_descriptors(layout, lbs, peer.layout, rbs))
                for lbs, rbs in jobs]
        sizes = [f.result(timeout=NO_HANG_S) for f in done]
    assert sizes == [len(lbs) * sum(layout.block_bytes) for lbs, _ in jobs]
    shape, last = (SPEC.block_size, SPEC.kv_heads, SPEC.head_dim), len(buffers) - 1
    for lbs, rbs in jobs:
        for lb, rb in zip(lbs, rbs):
            np.testing.assert_array_equal(rows(buffers[last], lb), block_values(SPEC.seed, last, rb, *shape))


def test_block_outside_the_remote_memory_fails(peer, local):
    _, layout, agent = local
    past_end = SPEC.num_blocks + 1  # the peer registered num_blocks + 1 (scratch) blocks
    with pytest.raises(KVTransferError):
        agent.read(peer.session, *read_descriptors(layout, [35], peer.layout, [past_end]))


def test_read_from_a_dead_peer_fails_fast(local):
    """A peer that exited (its port refuses): KVTransferError, for a session seen before or not."""
    _, layout, agent = local
    dying = start_peer(dataclasses.replace(SPEC, fill_blocks=[1]))
    desc = read_descriptors(layout, [39], dying.layout, [1])
    assert agent.read(dying.session, *desc) == sum(layout.block_bytes)
    dying.stop()
    for session in (dying.session, f"127.0.0.1:{_closed_port()}"):
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            with pytest.raises(KVTransferError):
                pool.submit(agent.read, session, *desc).result(timeout=NO_HANG_S)


def test_closed_agent_refuses_reads(peer):
    main_kv, depths = allocate(dataclasses.replace(SPEC, layers=1, depths=0))
    buffers = kv_buffers(main_kv, depths)
    agent = KVTransferAgent.start("127.0.0.1", "tcp", regions_of(buffers))
    assert agent.session.startswith("127.0.0.1:")
    agent.close()
    agent.close()
    with pytest.raises(KVTransferError):
        agent.read(peer.session, [buffers[0].data_ptr()], [peer.layout.buffer_addrs[0]], [16])


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_read_larger_than_one_mooncake_batch():
    """2560 scattered descriptors: more than Mooncake's TCP per-peer queue (2048) takes at once."""
    spec = PeerSpec(layers=3, depths=2, num_blocks=600, block_size=1, kv_heads=1, head_dim=4,
                    fill_blocks=list(range(0, 512, 2)), seed=5)
    big = start_peer(spec)
    try:
        main_kv, depths = allocate(dataclasses.replace(spec, num_blocks=300))
        buffers = kv_buffers(main_kv, depths)
        layout = layout_of(buffers, spec.block_size)
        agent = KVTransferAgent.start("127.0.0.1", "tcp", regions_of(buffers))
        local_blocks = list(range(255, -1, -1))  # descending: no two neighbours coalesce
        desc = read_descriptors(layout, local_blocks, big.layout, spec.fill_blocks)
        assert len(desc.lengths) == 10 * 256
        agent.read(big.session, *desc)
        agent.close()
        for i, buffer in enumerate(buffers):
            got = buffer.numpy()
            for lb, rb in zip(local_blocks, spec.fill_blocks):
                np.testing.assert_array_equal(got[lb], block_values(spec.seed, i, rb, 1, 1, 4)[0])
    finally:
        big.stop()
