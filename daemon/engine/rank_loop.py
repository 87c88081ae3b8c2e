"""Rank 0's event loop: intake → step → emit, awaiting the device instead of blocking on it.

One iteration:
  1. wait for work (a request channel message) when the engine is idle;
  2. intake: AddRequest / AbortRequest messages into the core (they take effect at the next launch);
  3. launch the next step; if a step must be collected, await its future — the loop keeps serving the
     request channel meanwhile — then collect it (the one host synchronisation per step);
  4. emit: the output op packs the step's tokens (and logprobs) and sends them without blocking; while
     frames are pending the loop pauses scheduling and retries (back-pressure, never a drop);
  5. every `stats_interval_s`, an EngineStats heartbeat (the HTTP side's /health and gauges).
A step still running after `step_timeout_s` (a hung peer rank under tensor parallelism) is fatal:
StepTimeout, and the process exits without waiting for the stuck device thread.
"""

from __future__ import annotations

import asyncio
import time

import msgspec
import numpy as np

from mtpserve import log
from mtpserve.engine.engine_core import EngineCore
from mtpserve.engine.rank_kv import KVExchange
from mtpserve.engine.request import EngineRequest, RemoteKV, SamplingParams
from mtpserve.engine.step_emission import StepEmission
from mtpserve.ipc import request_channel as rc
from mtpserve.ops import OutputSender, SendStatus, StepLogprobs

BACKPRESSURE_POLL_S = 0.002


class StepTimeout(RuntimeError):
    """A launched step did not finish in time: the device, or a peer rank's collective, is stuck."""


def engine_request(msg: rc.AddRequest) -> EngineRequest:
    """The wire's request as the engine's (same field names); ValueError on parameters it refuses."""
    params = SamplingParams(**msgspec.structs.asdict(msg.sampling))
    return EngineRequest(msg.request_id, tuple(msg.prompt_token_ids), params, hold_kv=msg.hold_kv,
                         remote=_remote_kv(msg.remote_prefill))


def _remote_kv(remote: rc.RemotePrefill | None) -> RemoteKV | None:
    if remote is None:
        return None
    return RemoteKV(source=remote, first_token_id=remote.first_token_id,
                    draft_token_ids=tuple(remote.draft_token_ids), deadline=remote.lease_deadline)


class RankLoop:
    def __init__(self, core: EngineCore, channel: rc.RequestChannelServer, sender: OutputSender,
                 stats_interval_s: float = 0.5, step_timeout_s: float | None = None) -> None:
        self.core = core
        self.step_timeout_s = step_timeout_s  # None: wait for a step forever
        self.channel = channel
        self.sender = sender
        self.stats_interval_s = stats_interval_s
        self._last_stats = 0.0
        self.num_steps = 0  # steps collected
        self.num_backpressure_waits = 0
        self.logger = log.get_logger("mtpserve.engine")
        self.kv: KVExchange = KVExchange()  # PD: rank_setup replaces it for the prefill/decode roles
        self.wake = asyncio.Event()  # set when something other than a message makes work (a KV read)

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self._wait_for_work(stop)
            self._intake(self.channel.poll())
            self.kv.before_step()
            out = await self._step()
            self.kv.announce()  # NOTE: KVHeld goes out before the first-token frames it belongs to
            await self._emit(out)
            self._heartbeat()

    async def _wait_for_work(self, stop: asyncio.Event) -> None:
        """Idle (nothing to run, or only KV reads in flight): sleep until a message, a finished
        read or `stop`, still sending heartbeats and ending leases."""
        while not self.core.has_runnable_work() and not stop.is_set():
            message = await self._next_message(self.stats_interval_s)
            if message is not None:
                self._intake([message])
            self.kv.before_step()
            self._heartbeat()

    async def _next_message(self, timeout_s: float):
        """The next request-channel message, or None after `timeout_s` or a `wake`."""
        recv = asyncio.ensure_future(self.channel.recv())
        woken = asyncio.ensure_future(self.wake.wait())
        await asyncio.wait((recv, woken), timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        woken.cancel()
        self.wake.clear()
        if recv.done():
            return recv.result()
        recv.cancel()
        return None

    def _intake(self, messages: list) -> None:
        for msg in messages:
            if isinstance(msg, rc.AbortRequest):
                for request_id in msg.request_ids:
                    self.core.abort_request(request_id)
            elif isinstance(msg, rc.ReleaseKV):
                for request_id in msg.request_ids:
                    self.core.release_kv(request_id)
            else:
                self._add(msg)

    def _add(self, msg: rc.AddRequest) -> None:
        try:
            self.core.add_request(engine_request(msg))
        except ValueError as exc:
            self.channel.send(rc.RequestFailed(msg.request_id, str(exc)))

    async def _step(self) -> StepEmission:
        launched = self.core.launch()
        if not self.core.must_collect(launched):
            return self.core.take_aborted()
        try:
            await asyncio.wait_for(asyncio.wrap_future(self.core.oldest_step()), self.step_timeout_s)
        except TimeoutError:
            raise StepTimeout(f"a step did not finish in {self.step_timeout_s} s") from None
        self.num_steps += 1
        return self.core.collect()

    async def _emit(self, out: StepEmission) -> None:
        if self.kv.role == "prefill":
            # NOTE: a prefill instance's requests end at their one token: FIRST_TOKEN frames carry
            # it with its drafts; finishes without a token (aborts) go in an ordinary frame.
            await self._send_first_tokens(select(out, out.num_tokens == 1))
            out = select(out, out.num_tokens != 1)
        if not out.request_ids:
            return
        await self._until_sent(self.sender.send_step(
            step_id=max(out.step_id, 0), req_ids=np.asarray(out.request_ids, np.int64),
            seq=out.seq, num_tokens=out.num_tokens,
            finish=out.finish_reasons.astype(np.int32), token_ids=out.token_ids,
            logprobs=_logprobs(out), num_topk=_topk_width(out)))

    async def _send_first_tokens(self, out: StepEmission) -> None:
        if not out.request_ids:
            return
        drafts = out.drafts if out.drafts is not None else np.zeros((len(out.request_ids), 0), np.int64)
        await self._until_sent(self.sender.send_first_token(
            step_id=max(out.step_id, 0), req_ids=np.asarray(out.request_ids, np.int64), seq=out.seq,
            finish=out.finish_reasons.astype(np.int32), token_ids=out.token_ids,
            logprobs=_logprobs(out), num_topk=_topk_width(out), draft_ids=drafts.astype(np.int64)))

    async def _until_sent(self, status_tensor) -> None:
        status = SendStatus.of(status_tensor)
        while status.frames_pending:
            self.num_backpressure_waits += 1
            await asyncio.sleep(BACKPRESSURE_POLL_S)  # NOTE: scheduling pauses while the reader is behind
            status = SendStatus.of(self.sender.flush())

    def _heartbeat(self) -> None:
        now = time.monotonic()
        if now - self._last_stats < self.stats_interval_s:
            return
        self._last_stats = now
        self.channel.send(engine_stats(self.core, self.num_steps, **self.kv.stats()))


def engine_stats(core: EngineCore, step_id: int, **pd_counters) -> rc.EngineStats:
    scheduler, acceptance = core.scheduler, core.acceptance
    return rc.EngineStats(
        step_id=step_id, num_running=len(scheduler.running),
        num_waiting=len(scheduler.waiting) + core.num_fetching,
        num_kv_blocks_used=scheduler.blocks.num_used_blocks,
        num_kv_blocks_total=scheduler.config.num_blocks, num_drafts=acceptance.num_draft_steps,
        num_draft_tokens=acceptance.num_draft_tokens,
        num_accepted_tokens=acceptance.num_accepted_tokens,
        num_accepted_per_pos=acceptance.accepted_per_pos.tolist(), timestamp=time.time(),
        num_kv_held=len(scheduler.held), **pd_counters)


def select(out: StepEmission, keep: np.ndarray) -> StepEmission:
    """The entries of `out` where `keep` [R] is true (token and logprob columns follow)."""
    if keep.all():
        return out
    per_token = np.repeat(keep, out.num_tokens)
    pick = lambda a, mask: None if a is None else a[mask]  # noqa: E731
    return StepEmission(
        out.step_id, tuple(r for r, k in zip(out.request_ids, keep) if k), out.num_tokens[keep],
        out.token_ids[per_token], out.finish_reasons[keep], pick(out.token_logprobs, per_token),
        pick(out.token_ranks, per_token), pick(out.top_ids, per_token), pick(out.top_logprobs, per_token),
        pick(out.num_top_logprobs, keep), pick(out.num_draft_tokens, keep),
        pick(out.num_accepted_tokens, keep), pick(out.seq, keep), pick(out.drafts, keep))


def _logprobs(out: StepEmission) -> StepLogprobs | None:
    if out.token_logprobs is None:
        return None
    return StepLogprobs(out.token_logprobs, out.token_ranks, out.top_ids, out.top_logprobs)


def _topk_width(out: StepEmission) -> int:
    return 0 if out.top_ids is None else int(out.top_ids.shape[1])
