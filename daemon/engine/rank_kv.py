"""Rank 0's part in PD (docs/pd.md): announce held KV (prefill role), read prefilled KV (decode role).

The rank loop calls `before_step()` ahead of each launch and `announce()` after each step, before it
emits that step's frames. Reads run on a small thread pool (Mooncake's read blocks its caller); their
completions come back to the loop thread, which alone touches the engine core.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Callable

from mtpserve import log
from mtpserve.engine.engine_core import EngineCore, KVFetch
from mtpserve.ipc import request_channel as rc


class KVExchange:
    """The mixed role: nothing moves between instances."""

    role = "mixed"
    session = ""
    layout: rc.KVLayout | None = None

    def before_step(self) -> None:
        pass

    def announce(self) -> None:
        pass

    def stats(self) -> dict:
        return {}

    def close(self) -> None:
        pass


class PrefillExchange(KVExchange):
    """Holds prompt KV for decode instances; frees it on ReleaseKV (in the core) or at lease end."""

    role = "prefill"

    def __init__(self, core: EngineCore, channel: rc.RequestChannelServer, agent, layout: rc.KVLayout):
        self.core, self.channel, self.agent, self.layout = core, channel, agent, layout
        self.session = agent.session
        self.num_expired = 0
        self.logger = log.get_logger("mtpserve.pd")

    def before_step(self) -> None:
        expired = self.core.expire_leases()
        if expired:
            self.num_expired += len(expired)
            self.logger.warning("kv lease expired", request_ids=expired)

    def announce(self) -> None:
        now = time.monotonic()
        for hold in self.core.take_kv_holds():
            self.channel.send(rc.KVHeld(request_id=hold.request_id, block_ids=list(hold.block_ids),
                                        num_tokens=hold.num_tokens,
                                        lease_expires_in=max(0.0, hold.deadline - now)))

    def stats(self) -> dict:
        return dict(num_kv_leases_expired=self.num_expired)

    def close(self) -> None:
        self.agent.close()


class DecodeExchange(KVExchange):
    """Reads prefilled prompts' KV into the blocks the core reserved for them."""

    role = "decode"

    def __init__(self, core: EngineCore, agent, layout: rc.KVLayout, threads: int, delay_s: float,
                 wake: Callable[[], None]) -> None:
        self.core, self.agent, self.layout = core, agent, layout
        self.session = agent.session
        self.delay_s, self.wake = delay_s, wake
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="kv-read")
        self._loop = asyncio.get_running_loop()
        self.num_fetches = 0
        self.fetch_bytes = 0
        self.fetch_seconds = 0.0
        self.logger = log.get_logger("mtpserve.pd")

    def before_step(self) -> None:
        stale = self.core.abandon_stale_fetches()
        if stale:
            self.logger.warning("kv read outlived the prefill's lease, recomputing", request_ids=stale)
        for fetch in self.core.start_kv_fetches():
            future = self._pool.submit(self._read, fetch)
            future.add_done_callback(
                lambda f, rid=fetch.request_id: self._loop.call_soon_threadsafe(self._done, rid, f))

    def _read(self, fetch: KVFetch) -> tuple[int, float]:
        """Transfer thread: one batched one-sided read of every block of every KV buffer."""
        from mtpserve.pd.kv_layout import read_descriptors

        if self.delay_s:
            time.sleep(self.delay_s)
        source: rc.RemotePrefill = fetch.source
        begin = time.perf_counter()
        local, remote, lengths = read_descriptors(self.layout, list(fetch.block_ids), source.kv_layout,
                                                  list(source.block_ids))
        nbytes = self.agent.read(source.kv_session, local, remote, lengths)
        return nbytes, time.perf_counter() - begin

    def _done(self, request_id: int, future: concurrent.futures.Future) -> None:
        error = future.exception()
        if error is None:
            nbytes, seconds = future.result()
            self.num_fetches += 1
            self.fetch_bytes += nbytes
            self.fetch_seconds += seconds
            self.logger.debug("kv read", request_id=request_id, bytes=nbytes, ms=round(seconds * 1e3, 2))
        else:
            self.logger.warning("kv read failed, recomputing the prompt", request_id=request_id,
                                error=f"{type(error).__name__}: {error}")
        self.core.kv_fetched(request_id, ok=error is None)
        self.wake()

    def stats(self) -> dict:
        return dict(num_kv_fetches=self.num_fetches, kv_fetch_bytes=self.fetch_bytes,
                    kv_fetch_seconds=self.fetch_seconds, num_kv_fallbacks=self.core.num_kv_fallbacks)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self.agent.close()
