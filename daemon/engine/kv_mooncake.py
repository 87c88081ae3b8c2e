"""The PD connectors' I/O on rank 0 (docs/pd.md): the Mooncake agent over this rank's KV buffers, KV
reads on a small thread pool, and KVHeld announcements on the request channel.

Mooncake's read blocks its caller, so reads run on `transfer_threads` threads; each completion comes
back to the loop thread (`call_soon_threadsafe`), which alone touches the engine core, and wakes the
rank loop in case it is idle.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from mtpserve import log
from mtpserve.config import PdConfig
from mtpserve.engine.kv_connector import KVConnector
from mtpserve.engine.kv_decode import DecodeConnector, KVFetch
from mtpserve.engine.kv_prefill import KVHold, PrefillConnector
from mtpserve.engine.model_runner import PaddleModelRunner
from mtpserve.ipc import request_channel as rc

if TYPE_CHECKING:
    from mtpserve.pd.kv_transfer import KVTransferAgent


class MooncakeEndpoint:
    """This rank's registered KV buffers: the `KVEndpoint` both PD connectors carry."""

    def __init__(self, agent: KVTransferAgent, layout: rc.KVLayout) -> None:
        self.agent, self.layout = agent, layout
        self.session = agent.session

    def close(self) -> None:
        self.agent.close()


def build_connector(pd: PdConfig, runner: PaddleModelRunner, block_size: int,
                    channel: rc.RequestChannelServer, wake: Callable[[], None]) -> KVConnector:
    """The connector of this instance's PD role; the mixed role moves nothing."""
    if pd.role == "mixed":
        return KVConnector()
    endpoint = start_endpoint(pd, runner, block_size)
    if pd.role == "prefill":
        return PrefillConnector(pd.kv_lease_timeout, announcer(channel), endpoint)
    reads = MooncakeReads(endpoint, pd.transfer_threads, pd.transfer_delay, wake)
    connector = DecodeConnector(reads.start, endpoint=reads)
    reads.done = connector.fetched
    return connector


def start_endpoint(pd: PdConfig, runner: PaddleModelRunner, block_size: int) -> MooncakeEndpoint:
    from mtpserve.pd.kv_layout import kv_buffers, layout_of, regions_of
    from mtpserve.pd.kv_transfer import KVTransferAgent

    buffers = kv_buffers(runner.kv, runner.proposer.kv if runner.proposer else [])
    agent = KVTransferAgent.start(pd.kv_host, pd.transfer_protocol, regions_of(buffers))
    return MooncakeEndpoint(agent, layout_of(buffers, block_size))


def announcer(channel: rc.RequestChannelServer) -> Callable[[KVHold], None]:
    def announce(hold: KVHold) -> None:
        channel.send(rc.KVHeld(request_id=int(hold.request_id), block_ids=list(hold.block_ids),
                               num_tokens=hold.num_tokens, mtp_key_start=hold.mtp_key_start,
                               lease_expires_in=max(0.0, hold.deadline - time.monotonic())))

    return announce


class MooncakeReads:
    """One batched one-sided read per prefilled prompt, each on a transfer thread. The decode
    connector's `KVEndpoint`: closing it ends the reads before the agent."""

    def __init__(self, endpoint: MooncakeEndpoint, threads: int, delay_s: float,
                 wake: Callable[[], None]) -> None:
        self.endpoint, self.delay_s, self.wake = endpoint, delay_s, wake
        self.session, self.layout = endpoint.session, endpoint.layout
        self.done: Callable[[int | str, bool, int, float], None] | None = None  # the connector's
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="kv-read")
        self._loop = asyncio.get_running_loop()
        self.logger = log.get_logger("mtpserve.pd")

    def start(self, fetch: KVFetch) -> None:
        future = self._pool.submit(self._read, fetch)
        future.add_done_callback(
            lambda f, rid=fetch.request_id: self._loop.call_soon_threadsafe(self._finished, rid, f))

    def _read(self, fetch: KVFetch) -> tuple[int, float]:
        """Transfer thread: every block of every KV buffer, in one batch."""
        from mtpserve.pd.kv_layout import read_descriptors

        if self.delay_s:
            time.sleep(self.delay_s)
        source = fetch.source
        assert isinstance(source, rc.RemotePrefill)
        begin = time.perf_counter()
        local, remote, lengths = read_descriptors(self.endpoint.layout, list(fetch.block_ids),
                                                  source.kv_layout, list(source.block_ids))
        nbytes = self.endpoint.agent.read(source.kv_session, local, remote, lengths)
        return nbytes, time.perf_counter() - begin

    def _finished(self, request_id: int | str, future: concurrent.futures.Future[tuple[int, float]]) -> None:
        error = future.exception()
        nbytes, seconds = future.result() if error is None else (0, 0.0)
        if error is None:
            self.logger.debug("kv read", request_id=request_id, bytes=nbytes, ms=round(seconds * 1e3, 2))
        else:
            self.logger.warning("kv read failed, recomputing the prompt", request_id=request_id,
                                error=f"{type(error).__name__}: {error}")
        if self.done is not None:
            self.done(request_id, error is None, nbytes, seconds)
        self.wake()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self.endpoint.close()
