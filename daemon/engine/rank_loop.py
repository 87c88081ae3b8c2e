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
from mtpserve.engine.request import EngineRequest, SamplingParams
from mtpserve.engine.step_output import StepOutput
from mtpserve.ipc import request_channel as rc
from mtpserve.ops import OutputSender, SendStatus, StepLogprobs

BACKPRESSURE_POLL_S = 0.002


class StepTimeout(RuntimeError):
    """A launched step did not finish in time: the device, or a peer rank's collective, is stuck."""


def engine_request(msg: rc.AddRequest) -> EngineRequest:
    """The wire's request as the engine's (same field names); ValueError on parameters it refuses."""
    params = SamplingParams(**msgspec.structs.asdict(msg.sampling))
    return EngineRequest(msg.request_id, tuple(msg.prompt_token_ids), params)


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

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self._wait_for_work(stop)
            self._intake(self.channel.poll())
            await self._emit(await self._step())
            self._heartbeat()

    async def _wait_for_work(self, stop: asyncio.Event) -> None:
        """Idle: sleep until a message or `stop`, still sending heartbeats."""
        while not self.core.has_unfinished_requests() and not stop.is_set():
            try:
                self._intake([await asyncio.wait_for(self.channel.recv(), self.stats_interval_s)])
            except TimeoutError:
                self._heartbeat()

    def _intake(self, messages: list) -> None:
        for msg in messages:
            if isinstance(msg, rc.AbortRequest):
                for request_id in msg.request_ids:
                    self.core.abort_request(request_id)
            else:
                self._add(msg)

    def _add(self, msg: rc.AddRequest) -> None:
        try:
            self.core.add_request(engine_request(msg))
        except ValueError as exc:
            self.channel.send(rc.RequestFailed(msg.request_id, str(exc)))

    async def _step(self) -> StepOutput:
        launched = self.core.launch()
        if not self.core.must_collect(launched):
            return self.core.take_aborted()
        try:
            await asyncio.wait_for(asyncio.wrap_future(self.core.oldest_step()), self.step_timeout_s)
        except TimeoutError:
            raise StepTimeout(f"a step did not finish in {self.step_timeout_s} s") from None
        self.num_steps += 1
        return self.core.collect()

    async def _emit(self, out: StepOutput) -> None:
        if not out.request_ids:
            return
        status = SendStatus.of(self.sender.send_step(
            step_id=max(out.step_id, 0), req_ids=np.asarray(out.request_ids, np.int64),
            seq=out.seq, num_tokens=out.num_tokens,
            finish=out.finish_reasons.astype(np.int32), token_ids=out.token_ids,
            logprobs=_logprobs(out), num_topk=_topk_width(out)))
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
        step_id=step_id, num_running=len(scheduler.running),
        num_waiting=len(scheduler.waiting), num_kv_blocks_used=scheduler.blocks.num_used_blocks,
        num_kv_blocks_total=scheduler.config.num_blocks, num_drafts=acceptance.num_draft_steps,
        num_draft_tokens=acceptance.num_draft_tokens,
        num_accepted_tokens=acceptance.num_accepted_tokens,
        num_accepted_per_pos=acceptance.accepted_per_pos.tolist(), timestamp=time.time())


def _logprobs(out: StepOutput) -> StepLogprobs | None:
    if out.token_logprobs is None:
        return None
    return StepLogprobs(out.token_logprobs, out.token_ranks, out.top_ids, out.top_logprobs)


def _topk_width(out: StepOutput) -> int:
    return 0 if out.top_ids is None else int(out.top_ids.shape[1])
