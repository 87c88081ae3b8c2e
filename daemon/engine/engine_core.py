"""The engine core of rank 0: intake, schedule, launch, finish (verify/update/emit). No I/O.

A process wrapper (rank_loop.py) owns the event loop, the request channel and the output op. It calls
`add_request` / `abort_request` as messages arrive, then per step the same two calls tests make through
`step()`: `launch_next()`, which returns the future of the step to finish now (or None), and
`finish_step(result)`. PD roles plug in through the KV connector (kv_connector.py); the core has no
role branches.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import itertools
import time
from typing import Generic, NamedTuple, TypeVar

import numpy as np

from mtpserve.engine.engine_emitter import Emitter, RowLogprobs
from mtpserve.engine.kv_connector import KVConnector, RequestId
from mtpserve.engine.request import EngineRequest, FinishReason, Request
from mtpserve.engine.runner import ModelRunner
from mtpserve.engine.sampler import check_bounds
from mtpserve.engine.scheduler import ScheduledRow, SchedulePlan, Scheduler, SchedulerConfig
from mtpserve.engine.spec_stats import AcceptanceStats
from mtpserve.engine.spec_cost import StepLoad
from mtpserve.engine.speculation import Speculation
from mtpserve.engine.step_emission import StepEmission
from mtpserve.engine.step_plan import StepPlan, StepResult
from mtpserve.engine.step_trace import StepTrace


@dataclasses.dataclass(frozen=True)
class CoreConfig:
    scheduler: SchedulerConfig = SchedulerConfig()
    overlap: bool = True  # plan and launch step N+1 before finishing step N
    eos_token_ids: tuple[int, ...] = ()
    seed: int = 0  # draws the seeds of requests that bring none
    adaptive_speculation: bool = True  # the policy picks each row's drafts; off: every row drafts k


class Launched(NamedTuple):
    """A step on the device: what was scheduled, the cost model's view of it, and its result to come."""

    plan: SchedulePlan
    shape: StepLoad
    future: concurrent.futures.Future[StepResult]
    launched_at: float  # perf_counter


R = TypeVar("R", bound=ModelRunner)  # the runner's own type, for callers that reach into it (tests, PD)


class EngineCore(Generic[R]):
    def __init__(self, config: CoreConfig, runner: R, connector: KVConnector | None = None) -> None:
        if runner.num_speculative_tokens != config.scheduler.num_speculative_tokens:
            raise ValueError("runner and scheduler disagree on num_speculative_tokens")
        self.config = config
        self.runner = runner
        self.connector = connector or KVConnector()
        self.scheduler = Scheduler(config.scheduler, on_finish=self.connector.on_finish)
        self.connector.bind(self.scheduler)
        self.acceptance = AcceptanceStats(config.scheduler.num_speculative_tokens)
        self.speculation = Speculation(config.scheduler.num_speculative_tokens,
                                       config.adaptive_speculation and not self.connector.drafts_leave,
                                       config.scheduler.max_num_seqs)
        self._trace = self.speculation.trace = StepTrace.from_env()  # a debug trace (MTP_STEP_TRACE)
        # NOTE: steps launched and not finished, oldest first; at most `_depth` (2 when overlapping).
        self._inflight: collections.deque[Launched] = collections.deque()
        self._depth = 2 if config.overlap else 1
        self._aborted: list[tuple[RequestId, int]] = []  # (request id, tokens it emitted)
        self._step_ids = itertools.count()
        self._arrivals = itertools.count()
        self._seeds = np.random.default_rng(config.seed)
        self.wait_seconds = 0.0  # host time blocked on device results in `step()`
        self._last_finish = 0.0  # perf_counter of the last finished step
        self.num_discarded_rows = 0  # rows computed for requests already finished/aborted/preempted

    # ---- intake ---------------------------------------------------------------------------------

    def add_request(self, request: EngineRequest) -> None:
        """Queue a request; raises ValueError if it can never run (ids outside the vocabulary, or
        more KV than the whole cache). Takes effect at the next launch, even while a step runs."""
        if max(request.prompt_ids) >= self.runner.vocab_size or min(request.prompt_ids) < 0:
            raise ValueError(f"request {request.request_id}: prompt token id outside "
                             f"[0, {self.runner.vocab_size})")
        seed = request.params.seed
        if seed is None:
            seed = int(self._seeds.integers(0, 2**63))
        state = Request(request, next(self._arrivals), seed)
        self.scheduler.check_fits(state)
        if not self.connector.on_add(state):
            self.scheduler.add(state)

    def abort_request(self, request_id: RequestId) -> bool:
        """Drop a request in any phase. Results of steps already launched for it are discarded."""
        request = self.connector.on_abort(request_id) or self.scheduler.abort(request_id)
        if request is None:
            return False
        self._aborted.append((request_id, len(request.output_ids)))
        return True

    def idle(self) -> None:
        """While nothing can run: the KV connector still acts (leases end, reads start)."""
        self.connector.before_step()

    @property
    def num_inflight_steps(self) -> int:
        """Steps launched on the device and not finished yet (1 between calls when overlapping)."""
        return len(self._inflight)

    @property
    def num_waiting(self) -> int:
        """Requests admitted but not running: queued, preempted, or held by the KV connector."""
        return len(self.scheduler.waiting) + self.connector.num_pending

    def trace_to(self, path: str) -> None:
        """Trace this core's steps and the policy's decisions to `path` (step_trace.py), whatever MTP_STEP_TRACE
        says: `bench engine --model-trace` traces the adaptive core alone, where every core of the process
        shares one pid."""
        self._trace = self.speculation.trace = StepTrace.to_file(path)

    def has_unfinished_requests(self) -> bool:
        return bool(self.connector.num_pending or self.has_runnable_work())

    def has_runnable_work(self) -> bool:
        """Unfinished work other than requests the KV connector still holds (e.g. KV reads)."""
        return bool(self.scheduler.num_unfinished or self._inflight or self._aborted)

    # ---- the step -------------------------------------------------------------------------------

    def step(self) -> StepEmission:
        """One step, synchronously (tests, benchmarks): the rank loop makes the same two calls."""
        future = self.launch_next()
        begin = time.perf_counter()
        result = None if future is None else future.result()
        self.wait_seconds += time.perf_counter() - begin
        return self.finish_step(result)

    def launch_next(self) -> concurrent.futures.Future[StepResult] | None:
        """1. let the connector act (leases, KV reads); 2. schedule the next step (upper bounds for
        what is still in flight) and launch it without waiting; 3. return the future of the oldest
        step when it must be finished now: `overlap` steps are in flight, or nothing new launched.
        None: nothing to finish yet (call `finish_step(None)` for the aborts)."""
        self.connector.before_step()
        plan = self.scheduler.schedule()
        if not plan.is_empty:
            drafts = self.speculation.choose(plan)
            step_plan = StepPlan.build(next(self._step_ids), plan, self.config.eos_token_ids,
                                       self.config.scheduler.num_speculative_tokens, drafts)
            self._inflight.append(Launched(plan, self.speculation.shape(plan, drafts),
                                           self.runner.launch(step_plan), time.perf_counter()))
        if self._inflight and (len(self._inflight) >= self._depth or plan.is_empty):
            return self._inflight[0].future
        return None

    def finish_step(self, result: StepResult | None) -> StepEmission:
        """Apply the oldest launched step's `result` (the future's value; None when `launch_next`
        returned None): verify/update/emit, plus a finish entry for every abort not reported yet."""
        out = self._emit_aborts(Emitter())
        if result is None:
            return self.connector.after_step(out.build(-1))
        launched = self._inflight.popleft()
        period = self._period(launched)
        prediction = self.speculation.observe(launched.shape, period, result.timing)
        if self._trace is not None:
            self._trace.record(launched.shape, period, result.timing, *prediction, int(result.num_emitted.sum()))
        return self.connector.after_step(self._collect(launched.plan, result, out))

    def _period(self, launched: Launched) -> float:
        """What the step cost the engine's throughput: the time from the previous step's finish (or its
        own launch, after an idle spell) to its finish. NOTE: not the device time alone: on a CPU host the
        host loop and the HTTP process take the same cores, and what a draft saves is whole periods."""
        now = time.perf_counter()
        period = now - max(launched.launched_at, self._last_finish)
        self._last_finish = now
        return period

    def _collect(self, plan: SchedulePlan, result: StepResult, out: Emitter) -> StepEmission:
        """Verify/update/emit: bounds-check, then commit each row still current, in one pass."""
        check_bounds(result.token_ids[result.token_ids >= 0], self.runner.vocab_size)
        verified = [i for i, row in enumerate(plan.rows) if self._apply_row(row, result, i, out)]
        rows = [plan.rows[i] for i in verified]
        num_drafts = np.array([row.num_tokens - 1 for row in rows], np.int64)
        num_accepted = result.num_accepted[verified]
        self.acceptance.observe(num_accepted, num_drafts)
        # NOTE: only a drafted window teaches acceptance: at depth 0 (64 streams) the two per-row arrays
        # below were built every step for nothing
        if rows and self.speculation.adaptive and num_drafts.any():
            self.speculation.observe_windows(np.array([row.slot for row in rows], np.int64), num_drafts,
                                             num_accepted, np.array([row.request.mtp_depth for row in rows]))
        return out.build(result.step_id)

    def _apply_row(self, row: ScheduledRow, result: StepResult, i: int, out: Emitter) -> bool:
        """Commit row i's tokens; True if it was a verified decode window."""
        if not self.scheduler.is_current(row):
            self.num_discarded_rows += 1  # finished, aborted or preempted after launch
            return False
        request = row.request
        tokens = result.token_ids[i, :result.num_emitted[i]]
        reason = FinishReason(int(result.finish_reason[i]))
        is_verified = not row.is_prefill and bool(result.is_valid[i])
        if is_verified:
            self._count_acceptance(request, row.num_tokens - 1, int(result.num_accepted[i]))
        self.scheduler.commit(row, tokens.tolist(), reason)
        if reason is not FinishReason.NONE:
            # NOTE: a PD decode instance read its requests' prompt KV; it prefilled none of it
            prompt = request.num_prefill_tokens - (request.num_cached_tokens or 0) if request.caches_prefix else 0
            self.speculation.observe_finished(prompt, len(request.output_ids))
        if tokens.shape[0] or reason is not FinishReason.NONE:
            width = request.params.logprobs
            drafts = None if result.drafts is None else result.drafts[i]
            out.add(request.request_id, tokens, reason, -1 if width is None else width,
                    _row_logprobs(result, i, tokens.shape[0], width), request, drafts=drafts)
        return is_verified

    def _count_acceptance(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        request.num_draft_tokens += num_drafts
        request.num_accepted_tokens += num_accepted

    def _emit_aborts(self, out: Emitter) -> Emitter:
        for request_id, num_emitted in self._aborted:
            out.add(request_id, np.zeros(0, np.int64), FinishReason.ABORT, seq=num_emitted)
        self._aborted.clear()
        return out

    # ---- prefix cache (docs/prefix-caching.md) ---------------------------------------------------

    def take_prefix_hits(self) -> list[tuple[RequestId, int]]:
        """(request id, cached prompt tokens) of the requests first admitted with a hit since the last
        call; the rank loop sends them (PrefixHits) right after the launch that admitted them."""
        return self.scheduler.prefix.take_first_hits()

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix; returns how many blocks were forgotten."""
        return self.scheduler.blocks.reset_prefix_cache()

    def prefix_cache_stats(self) -> dict[str, int]:
        """The EngineStats fields of the prefix cache, under their names there."""
        blocks = self.scheduler.blocks
        return {"prefix_cache_queries": self.scheduler.prefix_cache_queries,
                "prefix_cache_hits": self.scheduler.prefix_cache_hits,
                "num_kv_blocks_cached": blocks.num_cached_blocks,
                "num_kv_blocks_evictable": blocks.num_evictable_blocks}

    def close(self) -> None:
        for launched in self._inflight:
            launched.future.result()
        self._inflight.clear()
        if self._trace is not None:
            self._trace.flush()
        self.runner.close()
        self.connector.close()


def _row_logprobs(result: StepResult, row: int, n: int, width: int | None) -> RowLogprobs | None:
    """The request's logprob columns for its n emitted tokens, cut to its own top-k width."""
    if width is None or result.logprobs is None:
        return None
    lp = result.logprobs
    return RowLogprobs(lp.token_logprobs[row, :n], lp.ranks[row, :n], lp.top_ids[row, :n, :width],
                       lp.top_logprobs[row, :n, :width])
