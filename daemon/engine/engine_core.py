"""The engine core of rank 0: intake, schedule, launch, collect, verify/update, emit. No I/O.

A process wrapper owns the event loop, the request channel and the output op; it calls `add_request`
/ `abort_request` as messages arrive and `step()` in a loop. Tests drive the same core in-process.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import time

import numpy as np

from mtpserve.engine.engine_emitter import Emitter
from mtpserve.engine.request import EngineRequest, FinishReason, Request
from mtpserve.engine.runner import ModelRunner, StepHandle
from mtpserve.engine.sampler import check_bounds
from mtpserve.engine.scheduler import ScheduledRow, SchedulePlan, Scheduler, SchedulerConfig
from mtpserve.engine.spec_stats import AcceptanceStats
from mtpserve.engine.step_emission import StepEmission
from mtpserve.engine.step_plan import StepPlan, StepResult


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    scheduler: SchedulerConfig = SchedulerConfig()
    overlap: bool = True  # plan and launch step N+1 before collecting step N
    eos_token_ids: tuple[int, ...] = ()
    seed: int = 0  # draws the seeds of requests that bring none
    kv_lease_s: float = 30.0  # prefill role: how long held KV waits for its decode instance
    fetch_margin_s: float = 1.0  # decode role: a source lease ending sooner than this is not read


@dataclasses.dataclass(frozen=True)
class KVHold:
    """Prefill role: a finished request's KV stays in `block_ids` until released or `deadline`."""

    request_id: int | str
    block_ids: tuple[int, ...]
    num_tokens: int  # positions with KV (the prompt)
    deadline: float  # time.monotonic()


@dataclasses.dataclass(frozen=True)
class KVFetch:
    """Decode role: read a prefilled prompt's KV from `source` into the local `block_ids`."""

    request_id: int | str
    block_ids: tuple[int, ...]
    source: object  # RemoteKV.source


class EngineCore:
    def __init__(self, config: EngineConfig, runner: ModelRunner) -> None:
        if runner.num_speculative_tokens != config.scheduler.num_speculative_tokens:
            raise ValueError("runner and scheduler disagree on num_speculative_tokens")
        self.config = config
        self.runner = runner
        self.scheduler = Scheduler(config.scheduler)
        self.acceptance = AcceptanceStats(config.scheduler.num_speculative_tokens)
        self._inflight: collections.deque[tuple[SchedulePlan, StepHandle]] = collections.deque()
        self._depth = 2 if config.overlap else 1
        self._aborted: list[tuple[int | str, int]] = []  # (request id, tokens it emitted)
        self._step_ids = itertools.count()
        self._arrivals = itertools.count()
        self._seeds = np.random.default_rng(config.seed)
        self.wait_seconds = 0.0  # host time blocked on device results (the per-step sync)
        self.num_discarded_rows = 0  # rows computed for requests already finished/aborted/preempted
        self._holds: list[KVHold] = []  # prefill role: announced by the next `take_kv_holds`
        self._lease_deadlines: dict[int | str, float] = {}
        self.num_kv_fallbacks = 0  # decode role: prefilled prompts recomputed here instead

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
        self.scheduler.add(Request(request, next(self._arrivals), seed))

    def abort_request(self, request_id: int | str) -> bool:
        """Drop a request in any phase (a held prefill KV included). Results of steps already
        launched for it are discarded."""
        if self.release_kv(request_id):
            return True
        request = self.scheduler.abort(request_id)
        if request is None:
            return False
        self._aborted.append((request_id, len(request.output_ids)))
        return True

    # ---- PD: prefill role ----------------------------------------------------------------------

    def take_kv_holds(self) -> list[KVHold]:
        """KV kept since the last call, to announce before the requests' first-token frames."""
        holds, self._holds = self._holds, []
        return holds

    def release_kv(self, request_id: int | str) -> bool:
        """Free a held prefill KV (the decode instance has read it, or never will)."""
        self._lease_deadlines.pop(request_id, None)
        return self.scheduler.release_held(request_id)

    def expire_leases(self, now: float | None = None) -> list[int | str]:
        """Release every held KV whose lease ended; returns their request ids."""
        now = time.monotonic() if now is None else now
        expired = [rid for rid, deadline in self._lease_deadlines.items() if deadline <= now]
        for request_id in expired:
            self.release_kv(request_id)
        return expired

    def _hold(self, request: Request) -> None:
        deadline = time.monotonic() + self.config.kv_lease_s
        self._lease_deadlines[request.request_id] = deadline
        self._holds.append(KVHold(request.request_id, tuple(self.scheduler.held[request.request_id]),
                                  int(request.prompt_ids.shape[0]), deadline))

    # ---- PD: decode role ------------------------------------------------------------------------

    def start_kv_fetches(self, now: float | None = None) -> list[KVFetch]:
        """Reserve blocks for prefilled requests and say which KV to read into them now; requests
        whose source lease is about to end recompute their prompt instead."""
        now = time.time() if now is None else now
        queued = len(self.scheduler.fetch_queue)
        started = self.scheduler.start_fetches(now, self.config.fetch_margin_s)
        self.num_kv_fallbacks += queued - len(started) - len(self.scheduler.fetch_queue)
        return [KVFetch(r.request_id, tuple(r.block_ids), r.remote.source) for r in started]

    def abandon_stale_fetches(self, now: float | None = None) -> list[int | str]:
        """Give up on reads still running after their source's lease ended (the prefill stopped
        answering): those requests recompute their prompt here instead of waiting for the read."""
        now = time.time() if now is None else now
        stale = [rid for rid, r in self.scheduler.fetching.items()
                 if r.remote is not None and now > r.remote.deadline]
        for request_id in stale:
            if not self.scheduler.abandon_fetch(request_id).is_finished:
                self.num_kv_fallbacks += 1
        return stale

    def kv_fetched(self, request_id: int | str, ok: bool) -> None:
        """A read started by `start_kv_fetches` finished; on failure the prompt is recomputed."""
        request = self.scheduler.fetch_done(request_id, ok)
        if request is not None and not ok:
            self.num_kv_fallbacks += 1

    @property
    def num_fetching(self) -> int:
        """Prefilled requests waiting for blocks or for their KV to arrive."""
        fetching = sum(not r.is_finished for r in self.scheduler.fetching.values())
        return fetching + len(self.scheduler.fetch_queue)

    @property
    def num_inflight_steps(self) -> int:
        """Steps launched on the device and not collected yet (1 between calls when overlapping)."""
        return len(self._inflight)

    def has_unfinished_requests(self) -> bool:
        return bool(self.scheduler.num_unfinished or self._inflight or self._aborted)

    def has_runnable_work(self) -> bool:
        """Unfinished work other than prefilled requests waiting for their KV to arrive."""
        return bool(self.scheduler.num_unfinished - self.num_fetching > 0 or self._inflight
                    or self._aborted)

    # ---- the step -------------------------------------------------------------------------------

    def step(self) -> StepEmission:
        """1. schedule the next step (upper bounds for what is still in flight) and launch it;
        2. if `overlap` steps are in flight (or nothing new could be launched), wait for the oldest;
        3. apply its results and return the emitted tokens and finishes.

        An asyncio wrapper runs the same parts itself so it can await the device instead of
        blocking: `launch()`, then if `must_collect(...)`: await `oldest_step()`, then `collect()`;
        otherwise `take_aborted()`.
        """
        launched = self.launch()
        if self.must_collect(launched):
            return self.collect()
        return self.take_aborted()

    def take_aborted(self) -> StepEmission:
        """Finish entries (reason ABORT) of aborts not yet reported; `collect` includes them too."""
        return self._emit_aborts(Emitter()).build(-1)

    def launch(self) -> bool:
        """Schedule and launch the next step without waiting; False if there was nothing to run."""
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return False
        step_plan = StepPlan.build(next(self._step_ids), plan, self.config.eos_token_ids,
                                   self.config.scheduler.num_speculative_tokens)
        self._inflight.append((plan, self.runner.launch(step_plan)))
        return True

    def must_collect(self, launched: bool) -> bool:
        return bool(self._inflight) and (len(self._inflight) >= self._depth or not launched)

    def oldest_step(self) -> StepHandle:
        """The handle (a concurrent.futures.Future for both runners) of the step `collect` takes."""
        return self._inflight[0][1]

    def collect(self) -> StepEmission:
        """Take the oldest launched step's results (waiting if needed) and apply them."""
        plan, handle = self._inflight.popleft()
        begin = time.perf_counter()
        result = handle.result()
        self.wait_seconds += time.perf_counter() - begin
        return self._collect(plan, result)

    def _collect(self, plan: SchedulePlan, result: StepResult) -> StepEmission:
        """Verify/update/emit: bounds-check, then commit each row still current, in one pass."""
        check_bounds(result.token_ids[result.token_ids >= 0], self.runner.vocab_size)
        out = self._emit_aborts(Emitter())
        verified = [i for i, row in enumerate(plan.rows) if self._apply_row(row, result, i, out)]
        self.acceptance.observe(result.num_accepted[verified])
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
            self._count_acceptance(request, int(result.num_accepted[i]))
        self.scheduler.commit(row, tokens.tolist(), reason)
        if request.request_id in self.scheduler.held:
            self._hold(request)
        if tokens.shape[0] or reason is not FinishReason.NONE:
            width = request.params.logprobs
            drafts = None if result.drafts is None else result.drafts[i]
            out.add(request.request_id, tokens, reason, -1 if width is None else width,
                    _row_logprobs(result, i, tokens.shape[0], width), request, drafts=drafts)
        return is_verified

    def _count_acceptance(self, request: Request, num_accepted: int) -> None:
        request.num_draft_tokens += self.config.scheduler.num_speculative_tokens
        request.num_accepted_tokens += num_accepted

    def _emit_aborts(self, out: Emitter) -> Emitter:
        for request_id, num_emitted in self._aborted:
            out.add(request_id, np.zeros(0, np.int64), FinishReason.ABORT, seq=num_emitted)
        self._aborted.clear()
        return out

    def close(self) -> None:
        for _, handle in self._inflight:
            handle.result()
        self._inflight.clear()
        self.runner.close()


def _row_logprobs(result: StepResult, row: int, n: int, width: int | None) -> tuple | None:
    """The request's logprob columns for its n emitted tokens, cut to its own top-k width."""
    if width is None or result.logprobs is None:
        return None
    lp = result.logprobs
    return (lp.token_logprobs[row, :n], lp.ranks[row, :n], lp.top_ids[row, :n, :width],
            lp.top_logprobs[row, :n, :width])
