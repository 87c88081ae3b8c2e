"""Continuous batching: which requests run in the next step, with how many tokens, in which KV blocks.

Pure host policy, no device code. One call to `schedule()` plans one step:
  1. running requests in arrival order (FCFS): a decode window of k+1 tokens each, or the next
     prefill chunk; KV for the window is reserved on top of what launched steps may still write.
     While any request decodes, the step's prompt tokens are capped (max_prefill_tokens_decoding);
  2. when KV runs out, the latest-arrived running request is preempted (recompute later) until the
     earlier one fits; nobody is admitted in a step that preempted;
  3. waiting requests in arrival order while a slot, token budget and KV blocks remain; the first
     one that does not fit stops admission (no overtaking). With prefix caching a request first
     reuses the longest cached prefix of its blocks (prefix_reuse.py) and prefills only the rest.
Results come back through `commit()`, one step late when the engine overlaps; it offers the blocks
they filled to the prefix cache.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
from collections.abc import Callable

from mtpserve.config import EngineConfig
from mtpserve.engine import mtp_window
from mtpserve.engine.block_manager import BlockManager, blocks_for
from mtpserve.engine.prefix_cache import PrefixHit
from mtpserve.engine.prefix_reuse import PrefixReuse
from mtpserve.engine.request import FinishReason, Request, RequestId, RequestStatus

_ENGINE = EngineConfig()  # the configuration's defaults

# NOTE: the KV connector's on_finish hook (kv_connector.py): True when it takes the blocks.
FinishHook = Callable[[Request, FinishReason], bool]


def _keep_nothing(request: Request, reason: FinishReason) -> bool:
    return False


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """The scheduler's limits; engine_factory.py fills them from the [engine] section, whose defaults
    (config/schema.py, the one place they are declared) are these fields' too."""

    max_num_seqs: int = _ENGINE.max_num_seqs
    max_num_batched_tokens: int = _ENGINE.max_num_batched_tokens
    max_prefill_chunk: int = _ENGINE.max_prefill_chunk
    max_prefill_tokens_decoding: int = _ENGINE.max_prefill_tokens_decoding  # 0: no cap of its own
    num_speculative_tokens: int = 0
    num_blocks: int = 1024
    block_size: int = _ENGINE.block_size
    max_model_len: int = 0  # prompt + max_tokens limit; 0: only the KV capacity limits
    # NOTE: the daemon turns it on ([engine] enable_prefix_caching); in-process engines opt in.
    enable_prefix_caching: bool = False
    cache_salt: bytes = b""  # the root of the block hash chains: the model and KV layout (prefix_cache.salt)
    prompt_window: int = 0  # a prompt's last positions the MTP depths run over (engine/mtp_window.py); 0: all

    def __post_init__(self) -> None:
        positive = ("max_num_seqs", "max_num_batched_tokens", "max_prefill_chunk", "num_blocks", "block_size")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.num_speculative_tokens < 0 or self.max_prefill_tokens_decoding < 0:
            raise ValueError("num_speculative_tokens and max_prefill_tokens_decoding must be >= 0")
        if self.max_num_batched_tokens < self.decode_window:
            raise ValueError("max_num_batched_tokens must hold at least one decode window (k+1)")

    @property
    def decode_window(self) -> int:
        return self.num_speculative_tokens + 1


@dataclasses.dataclass(frozen=True)
class ScheduledRow:
    """One request's share of a step. Prefill rows carry host-known tokens; decode rows read theirs
    (last token + drafts) from device state."""

    request: Request
    epoch: int
    slot: int
    is_prefill: bool
    num_tokens: int  # prefill chunk length, or a decode window: its drafts + 1 (an upper bound)
    start_pos: int  # first position of a prefill chunk (decode rows: device-resident)
    emits: bool  # a decode window, or the last prefill chunk

    @property
    def before_key_start(self) -> bool:
        """A prompt chunk that ends before its request's key start: the MTP depths run over its last position
        alone, which no draft reads (mtp_window.py), so a depth its step does not run leaves no gap."""
        return self.is_prefill and self.start_pos + self.num_tokens <= self.request.mtp_key_start


@dataclasses.dataclass(frozen=True)
class BlockWrite:
    """Append `block_ids` to the device block table of `slot` starting at column `first_col`."""

    slot: int
    first_col: int
    block_ids: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class SchedulePlan:
    rows: tuple[ScheduledRow, ...]
    inserts: tuple[Request, ...]  # requests that take a device slot in this step
    block_writes: tuple[BlockWrite, ...]
    preempted: tuple[Request, ...]
    # NOTE: (source, destination) KV blocks, copied in order before the step's forward pass: a prefix
    # hit's private copy of the block its recomputed positions are in.
    block_copies: tuple[tuple[int, int], ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(row.num_tokens for row in self.rows)

    @property
    def is_empty(self) -> bool:
        return not self.rows


@dataclasses.dataclass
class _PlanBuilder:
    budget: int
    prefill_budget: int  # prompt tokens the step may still carry (within `budget`)
    rows: list[ScheduledRow] = dataclasses.field(default_factory=list)
    inserts: list[Request] = dataclasses.field(default_factory=list)
    block_writes: list[BlockWrite] = dataclasses.field(default_factory=list)
    preempted: list[Request] = dataclasses.field(default_factory=list)
    block_copies: list[tuple[int, int]] = dataclasses.field(default_factory=list)

    def build(self) -> SchedulePlan:
        return SchedulePlan(tuple(self.rows), tuple(self.inserts), tuple(self.block_writes),
                            tuple(self.preempted), tuple(self.block_copies))


class Scheduler:
    def __init__(self, config: SchedulerConfig, on_finish: FinishHook = _keep_nothing) -> None:
        self.config = config
        self.blocks = BlockManager(config.num_blocks, config.block_size)
        self.waiting: collections.deque[Request] = collections.deque()  # sorted by arrival
        self.running: list[Request] = []  # sorted by arrival
        self._free_slots = list(range(config.max_num_seqs - 1, -1, -1))
        self._by_id: dict[RequestId, Request] = {}
        self._on_finish = on_finish
        self.num_preemptions = 0
        self.prefix = PrefixReuse(config.enable_prefix_caching, self.blocks, config.block_size,
                                  config.num_speculative_tokens, config.cache_salt)

    # ---- intake ---------------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        """Queue a request by arrival (one a KV connector held back may arrive late)."""
        if request.request_id in self._by_id:
            raise ValueError(f"duplicate request id {request.request_id}")
        self.check_fits(request)
        self._by_id[request.request_id] = request
        self._enqueue(request)

    def abort(self, request_id: RequestId) -> Request | None:
        """Drop a request in any phase; returns it (finished, reason ABORT) or None if unknown."""
        request = self._by_id.get(request_id)
        if request is None:
            return None
        if request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        self._finish(request, FinishReason.ABORT)
        return request

    def get(self, request_id: RequestId) -> Request | None:
        return self._by_id.get(request_id)

    @property
    def num_unfinished(self) -> int:
        return len(self._by_id)

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    @property
    def prefix_cache_queries(self) -> int:
        return self.prefix.queries

    @property
    def prefix_cache_hits(self) -> int:
        return self.prefix.hits

    # ---- planning -------------------------------------------------------------------------------

    def schedule(self) -> SchedulePlan:
        plan = _PlanBuilder(self.config.max_num_batched_tokens, self._prefill_budget())
        for request in list(self.running):
            if request.status is RequestStatus.RUNNING:
                self._schedule_running(request, plan)
        if not plan.preempted:
            self._admit_waiting(plan)
        return plan.build()

    def _prefill_budget(self) -> int:
        """Prompt tokens the next step may carry. NOTE: on a CPU host a step's time grows with its tokens
        (~50 us each on the bundled model); a burst of 63 prompts that filled the whole 2,048-token budget
        made every stream's next gaps ~100 ms, over 3x the p99 gap of a steady load."""
        cap = self.config.max_prefill_tokens_decoding
        if cap and any(not r.is_prefilling for r in self.running):
            return min(cap, self.config.max_num_batched_tokens)
        return self.config.max_num_batched_tokens

    def _schedule_running(self, request: Request, plan: _PlanBuilder) -> None:
        if self._is_surely_done(request):
            return
        num_tokens = self._num_new_tokens(request, plan)
        if num_tokens > 0 and self._reserve(request, num_tokens, plan):
            self._add_row(request, num_tokens, plan)

    def _admit_waiting(self, plan: _PlanBuilder) -> None:
        while self.waiting and self._free_slots:
            request = self.waiting[0]
            request.mtp_key_start = self._key_start(request)
            hit = self.prefix.find(request)
            num_tokens = self._num_new_tokens(request, plan, skip=hit.num_computed)
            needed = max(request.num_kv_tokens, hit.num_computed) + num_tokens
            if num_tokens <= 0 or not self._fits(request, hit, needed):
                return
            self.waiting.popleft()
            self._start(request)
            plan.inserts.append(request)
            self.prefix.reuse(request, hit, plan.block_copies)
            if request.block_ids:
                plan.block_writes.append(BlockWrite(request.slot_id, 0, tuple(request.block_ids)))
            self._grow(request, needed, plan)
            self._add_row(request, num_tokens, plan)

    def _fits(self, request: Request, hit: PrefixHit, num_tokens: int) -> bool:
        """KV for `num_tokens` positions, the hit's shared blocks counted as held (taking one that no
        table holds removes it from the free count)."""
        missing = blocks_for(num_tokens, self.config.block_size) - len(request.block_ids) - hit.num_shared
        idle = sum(self.blocks.refs(b) == 0 for b in hit.shared)
        return missing + idle <= self.blocks.num_free_blocks

    def _num_new_tokens(self, request: Request, plan: _PlanBuilder, skip: int = 0) -> int:
        """The next row's tokens; `skip`: prompt positions a prefix hit provides."""
        if not request.is_prefilling:
            # NOTE: the window verifies the drafts the policy had this request propose last step
            window = min(request.num_drafts, self.config.num_speculative_tokens) + 1
            return window if plan.budget >= window else 0
        remaining = request.num_prefill_tokens - max(request.num_prefill_scheduled, skip)
        return max(0, min(remaining, plan.budget, plan.prefill_budget, self.config.max_prefill_chunk))

    def _is_surely_done(self, request: Request) -> bool:
        # NOTE: every launched emitting step yields at least one token unless the request stops, so
        # once those reach max_tokens another window would only be discarded.
        pending = len(request.output_ids) + request.num_inflight_steps
        return not request.is_prefilling and pending >= request.params.max_tokens

    def _reserve(self, request: Request, num_tokens: int, plan: _PlanBuilder) -> bool:
        """Make room for `num_tokens` more KV slots, preempting later arrivals; False if the request
        itself had to be preempted."""
        needed = request.num_kv_tokens + request.num_inflight_tokens + num_tokens
        while not self.blocks.can_grow(request.block_ids, needed):
            if self._reclaim_waiting_blocks():
                continue
            victim = self.running[-1]
            self._preempt(victim, plan)
            if victim is request:
                return False
        self._grow(request, needed, plan)
        return True

    def _grow(self, request: Request, num_tokens: int, plan: _PlanBuilder) -> None:
        first_col = len(request.block_ids)
        # NOTE: the run a table starts claims room for what its request may still write (block_manager.py)
        expected = request.num_prefill_tokens + request.params.max_tokens + self.config.decode_window
        new = self.blocks.grow(request.block_ids, num_tokens, expected_tokens=expected)
        if new:
            plan.block_writes.append(BlockWrite(request.slot_id, first_col, tuple(new)))

    def _add_row(self, request: Request, num_tokens: int, plan: _PlanBuilder) -> None:
        is_prefill = request.is_prefilling
        start = request.num_prefill_scheduled
        if is_prefill:
            request.num_prefill_scheduled += num_tokens
            plan.prefill_budget -= num_tokens
        emits = not request.is_prefilling
        plan.rows.append(ScheduledRow(request, request.epoch, request.slot_id, is_prefill, num_tokens,
                                      start, emits))
        request.num_inflight_tokens += num_tokens
        request.num_inflight_steps += int(emits)
        plan.budget -= num_tokens

    # ---- state changes --------------------------------------------------------------------------

    def _key_start(self, request: Request) -> int:
        """The prefill instance's where its KV is the prompt's here (it wrote the MTP KV from there on), else
        mtp_window.key_start of the positions its prefill writes: its prompt where a prefill instance sends that
        KV without saying (an older one, which ran its depths over the same window if set alike), else what it
        prefills here."""
        if request.remote_key_start is not None:
            return request.remote_key_start
        prefilled = request.prompt_ids.shape[0] if request.remote is not None else request.num_prefill_tokens
        return mtp_window.key_start(int(prefilled), self.config.prompt_window, self.config.block_size)

    def _start(self, request: Request) -> None:
        request.status = RequestStatus.RUNNING
        request.slot = self._free_slots.pop()
        keys = [r.arrival for r in self.running]
        self.running.insert(bisect.bisect(keys, request.arrival), request)

    def _preempt(self, request: Request, plan: _PlanBuilder) -> None:
        self._release(request, keep_blocks=False)
        request.preempt()
        self.num_preemptions += 1
        plan.preempted.append(request)
        self._enqueue(request)

    def _enqueue(self, request: Request) -> None:
        if self.waiting and self.waiting[-1].arrival > request.arrival:
            keys = [r.arrival for r in self.waiting]
            self.waiting.insert(bisect.bisect(keys, request.arrival), request)
        else:
            self.waiting.append(request)

    def _reclaim_waiting_blocks(self) -> bool:
        """Free the blocks of the latest waiting request that holds KV it did not compute in a
        step (read from a prefill instance); it recomputes instead. False if none does."""
        for request in reversed(self.waiting):
            if request.block_ids:
                self.blocks.free(request.block_ids)
                request.preempt()
                self.num_preemptions += 1
                return True
        return False

    def _release(self, request: Request, keep_blocks: bool) -> None:
        """Give back the slot, and the blocks unless their new owner (the KV connector) keeps them."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
            self._free_slots.append(request.slot_id)
        if not keep_blocks:
            self.blocks.free(request.block_ids)
        request.block_ids = []

    def _finish(self, request: Request, reason: FinishReason) -> None:
        self._release(request, keep_blocks=self._on_finish(request, reason))
        request.finish(reason)
        del self._by_id[request.request_id]

    # ---- results --------------------------------------------------------------------------------

    def is_current(self, row: ScheduledRow) -> bool:
        """False for rows of requests that finished, were aborted or preempted since launch."""
        return row.request.status is RequestStatus.RUNNING and row.epoch == row.request.epoch

    def commit(self, row: ScheduledRow, token_ids: list[int], reason: FinishReason) -> None:
        """Apply one current row's device result: its KV is written and `token_ids` emitted."""
        request = row.request
        request.num_inflight_tokens -= row.num_tokens
        request.num_inflight_steps -= int(row.emits)
        # NOTE: a decode window keeps KV for its input token plus each accepted draft, i.e. one
        # slot per emitted token; a prefill chunk keeps all of its tokens.
        request.num_kv_tokens += row.num_tokens if row.is_prefill else len(token_ids)
        request.output_ids.extend(token_ids)
        self.prefix.offer(request)
        if reason is not FinishReason.NONE:
            self._finish(request, reason)

    def check_fits(self, request: Request) -> None:
        """ValueError when the request could never run: too long for the model or the cache."""
        total = request.num_prefill_tokens + request.params.max_tokens
        if self.config.max_model_len and total > self.config.max_model_len:
            raise ValueError(f"request {request.request_id}: prompt + max_tokens = {total} exceeds "
                             f"max_model_len {self.config.max_model_len}")
        # NOTE: a lone request must always be able to run: prompt, all outputs, and the two decode
        # windows that may be reserved while one is in flight.
        longest = request.num_prefill_tokens + request.params.max_tokens + 2 * self.config.decode_window
        if blocks_for(longest, self.config.block_size) > self.config.num_blocks:
            raise ValueError(f"request {request.request_id} needs {longest} KV slots, the cache has "
                             f"{self.config.num_blocks * self.config.block_size}")
