"""Rank 0's event loop: intake -> launch -> (await the device) -> finish -> emit, never blocking on it.

One iteration:
  1. wait for work (a request channel message) when the engine is idle;
  2. intake: AddRequest / AbortRequest / ReleaseKV messages into the core (they take effect at the
     next launch); ResetPrefixCache is done at once and answered (PrefixCacheReset, same token);
  3. `core.launch_next()` launches the next step and hands back the future of the step to finish now,
     if any; the prefix hits of the requests it admitted go out at once (PrefixHits), so before any of
     their output frames; the loop awaits the future (serving the request channel meanwhile) and
     `core.finish_step()` applies it: the one host synchronisation per step;
  4. emit: the output op packs the step's tokens (and logprobs) and sends them without blocking; while
     frames are pending the loop pauses scheduling and retries (back-pressure, never a drop);
  5. every `stats_interval_s`, an EngineStats heartbeat (the HTTP side's /health and gauges).
A step still running after `step_timeout_s` (a hung peer rank under tensor parallelism) is fatal:
StepTimeout, and the process exits without waiting for the stuck device thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from typing import Any

import numpy as np

from mtpserve import log
from mtpserve.engine.engine_core import EngineCore
from mtpserve.engine.kv_connector import RequestId
from mtpserve.engine.request import EngineRequest, RemoteKV
from mtpserve.engine.step_emission import StepEmission
from mtpserve.engine.step_plan import StepResult
from mtpserve.ipc import request_channel as rc
from mtpserve.ops import OutputSender, SendStatus, StepLogprobs

BACKPRESSURE_POLL_S = 0.002


class StepTimeout(RuntimeError):
    """A launched step did not finish in time: the device, or a peer rank's collective, is stuck."""


def engine_request(msg: rc.AddRequest) -> EngineRequest:
    """The wire's request as the engine's; ValueError on parameters it refuses."""
    return EngineRequest(msg.request_id, tuple(msg.prompt_token_ids), msg.sampling, hold_kv=msg.hold_kv,
                         remote=_remote_kv(msg.remote_prefill))


def _remote_kv(remote: rc.RemotePrefill | None) -> RemoteKV | None:
    if remote is None:
        return None
    return RemoteKV(source=remote, first_token_id=remote.first_token_id,
                    draft_token_ids=tuple(remote.draft_token_ids), deadline=remote.lease_deadline,
                    mtp_key_start=remote.mtp_key_start)


class RankLoop:
    def __init__(self, core: EngineCore, channel: rc.RequestChannelServer, sender: OutputSender,
                 stats_interval_s: float = 0.5, step_timeout_s: float | None = None,
                 wake: asyncio.Event | None = None) -> None:
        """`wake`: set by whatever makes work besides a message (a KV read that finished)."""
        self.core = core
        self.step_timeout_s = step_timeout_s  # None: wait for a step forever
        self.channel = channel
        self.sender = sender
        self.stats_interval_s = stats_interval_s
        self._last_stats = 0.0
        self.num_steps = 0  # steps finished
        self.num_backpressure_waits = 0
        self.logger = log.get_logger("mtpserve.engine")
        self.wake = wake or asyncio.Event()

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self._wait_for_work(stop)
            self._intake(self.channel.poll())
            result = await self._result_of(self._launch())
            await self._emit(self.core.finish_step(result))
            self._heartbeat()

    async def _wait_for_work(self, stop: asyncio.Event) -> None:
        """Idle (nothing to run, or only KV reads in flight): sleep until a message, a finished
        read or `stop`, still sending heartbeats and ending leases."""
        while not self.core.has_runnable_work() and not stop.is_set():
            message = await self._next_message(self.stats_interval_s)
            if message is not None:
                self._intake([message])
            self.core.idle()
            self._heartbeat()

    async def _next_message(self, timeout_s: float) -> rc.ToEngine | None:
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

    def _intake(self, messages: list[rc.ToEngine]) -> None:
        for msg in messages:
            if isinstance(msg, rc.AbortRequest):
                for request_id in msg.request_ids:
                    self.core.abort_request(request_id)
            elif isinstance(msg, rc.ReleaseKV):
                self.core.connector.release(msg.request_ids)
            elif isinstance(msg, rc.ResetPrefixCache):
                self.channel.send(rc.PrefixCacheReset(msg.token, self.core.reset_prefix_cache()))
            else:
                self._add(msg)

    def _add(self, msg: rc.AddRequest) -> None:
        try:
            self.core.add_request(engine_request(msg))
        except ValueError as exc:
            self.channel.send(rc.RequestFailed(msg.request_id, str(exc)))

    def _launch(self) -> concurrent.futures.Future[StepResult] | None:
        """Launch the next step; report its admissions' prefix hits before any of their frames exists."""
        future = self.core.launch_next()
        hits = self.core.take_prefix_hits()
        if hits:
            self.channel.send(prefix_hits(hits))
        return future

    async def _result_of(self, future: concurrent.futures.Future[StepResult] | None) -> StepResult | None:
        if future is None:
            return None
        try:
            result = await asyncio.wait_for(asyncio.wrap_future(future), self.step_timeout_s)
        except TimeoutError:
            raise StepTimeout(f"a step did not finish in {self.step_timeout_s} s") from None
        self.num_steps += 1
        return result

    async def _emit(self, out: StepEmission) -> None:
        tokens, first_tokens = out.split_handoff()
        # NOTE: a PD prefill's requests end at their one token: FIRST_TOKEN frames carry it with its
        # drafts; finishes without a token (aborts) go in an ordinary frame.
        await self._send_first_tokens(first_tokens)
        await self._send_tokens(tokens)

    async def _send_tokens(self, out: StepEmission) -> None:
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

    async def _until_sent(self, status_tensor: Any) -> None:
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
        self.channel.send(engine_stats(self.core, self.num_steps))


def engine_stats(core: EngineCore, step_id: int) -> rc.EngineStats:
    scheduler, acceptance = core.scheduler, core.acceptance
    return rc.EngineStats(
        step_id=step_id, num_running=len(scheduler.running), num_waiting=core.num_waiting,
        num_kv_blocks_used=scheduler.blocks.num_used_blocks,
        num_kv_blocks_total=scheduler.config.num_blocks, num_drafts=acceptance.num_draft_steps,
        num_draft_tokens=acceptance.num_draft_tokens,
        num_accepted_tokens=acceptance.num_accepted_tokens,
        num_accepted_per_pos=acceptance.accepted_per_pos.tolist(),
        num_drafted_per_pos=acceptance.drafted_per_pos.tolist(),
        num_rows_by_drafts=core.speculation.rows_by_drafts.tolist(),
        spec_predicted_seconds=core.speculation.predicted_seconds,
        spec_measured_seconds=core.speculation.measured_seconds, timestamp=time.time(),
        num_preemptions=scheduler.num_preemptions, num_discarded_rows=core.num_discarded_rows,
        **core.connector.stats(), **core.prefix_cache_stats())


def prefix_hits(hits: list[tuple[RequestId, int]]) -> rc.PrefixHits:
    # NOTE: the rank loop's requests carry the wire's integer ids (engine_request).
    return rc.PrefixHits(request_ids=[int(rid) for rid, _ in hits], cached_tokens=[n for _, n in hits])


def _logprobs(out: StepEmission) -> StepLogprobs | None:
    # NOTE: the four columns exist together (engine_emitter.py), or none does.
    lp, ranks, top_ids, top_lp = out.token_logprobs, out.token_ranks, out.top_ids, out.top_logprobs
    if lp is None or ranks is None or top_ids is None or top_lp is None:
        return None
    return StepLogprobs(lp, ranks, top_ids, top_lp)


def _topk_width(out: StepEmission) -> int:
    return 0 if out.top_ids is None else int(out.top_ids.shape[1])
