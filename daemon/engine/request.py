"""The engine-side request: what the client asked for and where the engine is with it."""

from __future__ import annotations

import dataclasses
import enum

import numpy as np

from mtpserve.ipc.sampling_params import SamplingParams, sampling_problems

RequestId = int | str  # the wire uses ints; tests use strings


@dataclasses.dataclass(frozen=True)
class RemoteKV:
    """Decode role (docs/pd.md): the prompt was prefilled by another instance, whose KV is read from
    `source` before the request starts decoding from `first_token_id` and its drafts."""

    source: object  # opaque to the engine: what the KV transfer layer needs to read the blocks
    first_token_id: int
    draft_token_ids: tuple[int, ...]
    deadline: float  # time.time() after which the source may have freed its blocks
    mtp_key_start: int | None = None  # the first position whose MTP KV the prefill wrote (None: not said)


@dataclasses.dataclass(frozen=True)
class EngineRequest:
    """One generation request as the engine receives it (already tokenized and validated)."""

    request_id: RequestId
    prompt_ids: tuple[int, ...]
    params: SamplingParams = SamplingParams()
    hold_kv: bool = False  # prefill role: keep the KV after the last token unless it stopped
    remote: RemoteKV | None = None  # decode role

    def __post_init__(self) -> None:
        for problem in sampling_problems(self.params):
            raise ValueError(f"request {self.request_id}: {problem}")
        if not self.prompt_ids:
            raise ValueError(f"request {self.request_id}: empty prompt")
        if self.remote is not None and self.params.max_tokens < 2:
            raise ValueError(f"request {self.request_id}: a prefilled request needs max_tokens >= 2")


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued, or preempted and waiting to recompute
    RUNNING = "running"  # owns a device slot and KV blocks
    FINISHED = "finished"


class FinishReason(enum.IntEnum):
    """Wire codes (fit in one byte); NONE means the request is still generating."""

    NONE = 0
    STOP = 1  # EOS or a stop token id
    LENGTH = 2  # max_tokens reached
    ABORT = 3


class Request:
    """Mutable engine state of one request; owned by the scheduler.

    Invariants (host view, updated when a step's results are collected):
      * `num_kv_tokens` tokens have their KV written on the device; `num_inflight_tokens` more are
        being written by launched steps (an upper bound for decode windows).
      * While decoding, every token but the last emitted one has KV: `num_kv_tokens == num_tokens - 1`.
      * `epoch` changes at each preemption, so results of steps launched before it are discarded.
    """

    def __init__(self, req: EngineRequest, arrival: int, seed: int) -> None:
        self.request_id = req.request_id
        self.prompt_ids = np.asarray(req.prompt_ids, dtype=np.int64)  # [P]
        self.params = req.params
        self.arrival = arrival
        self.seed = seed
        self.status = RequestStatus.WAITING
        self.finish_reason = FinishReason.NONE
        self.output_ids: list[int] = []
        self.slot: int | None = None
        self.block_ids: list[int] = []
        self.epoch = 0
        self.num_preemptions = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.hold_kv = req.hold_kv
        self.remote = req.remote  # None once its KV arrived (or the engine fell back to recompute)
        self.remote_start: tuple[int, np.ndarray] | None = None  # (last token, drafts) of arrived KV
        # NOTE: prefix caching (prefix_cache.py). KV read from a prefill instance is not cached here.
        self.caches_prefix = req.remote is None
        self.block_hashes: list[bytes] = []  # of its full blocks of tokens, kept across preemptions
        self.num_cached_tokens: int | None = None  # prompt tokens reused at its first admission
        # NOTE: set at each admission (Scheduler, engine/mtp_window.py) and kept till the next: the device's copy
        # is the slot's, and a prefill whose KV is lost and recomputed here keeps its slot
        self.mtp_key_start = 0  # the first position whose MTP KV its drafts read
        self.remote_key_start: int | None = None  # the prefill instance's, while its KV is the prompt's here
        if req.remote is not None:
            self.output_ids.append(req.remote.first_token_id)
        self._reset_progress()

    def _reset_progress(self) -> None:
        self.prefill_ids = np.concatenate(
            [self.prompt_ids, np.asarray(self.output_ids, dtype=np.int64)])  # [P + O]
        # NOTE: a plain int, read for every running request at every step.
        self.num_prefill_tokens = int(self.prefill_ids.shape[0])
        self.num_prefill_scheduled = 0
        self.num_kv_tokens = 0
        self.num_inflight_tokens = 0
        self.num_inflight_steps = 0
        self.num_drafts = 0  # drafts the device holds for the next decode window (the policy's choice)
        self.mtp_depth = 1 << 30  # the fewest MTP depths any step of it ran: deeper ones have gaps
        self.num_blocks_cached = 0  # leading blocks of its table already offered to the prefix cache

    @property
    def num_tokens(self) -> int:
        return int(self.prompt_ids.shape[0]) + len(self.output_ids)

    def tokens(self, start: int, stop: int) -> np.ndarray:
        """Its tokens (prompt, then outputs) start..stop-1, fewer where they end, int64; only those are built."""
        num_prompt = self.prompt_ids.shape[0]
        if stop <= num_prompt:
            return self.prompt_ids[start:stop]
        outputs = np.asarray(self.output_ids[max(start - num_prompt, 0):stop - num_prompt], dtype=np.int64)
        return outputs if start >= num_prompt else np.concatenate([self.prompt_ids[start:], outputs])

    @property
    def is_prefilling(self) -> bool:
        return self.num_prefill_scheduled < self.num_prefill_tokens

    @property
    def slot_id(self) -> int:
        """The device slot of a running request (the scheduler sets it when the request starts)."""
        assert self.slot is not None, f"request {self.request_id} has no slot"
        return self.slot

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def preempt(self) -> None:
        """Drop device state; the request recomputes prompt + outputs so far when readmitted."""
        self.status = RequestStatus.WAITING
        self.slot = None
        self.block_ids = []
        self.epoch += 1
        self.num_preemptions += 1
        self.remote_start = None
        self.remote_key_start = None
        self._reset_progress()

    def kv_arrived(self) -> None:
        """The prompt's KV came from the prefill instance: the request decodes from its first token."""
        remote, self.remote = self.remote, None
        assert remote is not None, "only a prefilled request's KV arrives"
        self.num_kv_tokens = int(self.prompt_ids.shape[0])
        self.num_prefill_scheduled = self.num_prefill_tokens
        self.remote_start = (remote.first_token_id, np.asarray(remote.draft_token_ids, np.int64))
        self.remote_key_start = remote.mtp_key_start
        self.num_drafts = len(remote.draft_token_ids)  # the scheduler caps it at this engine's k

    def kv_lost(self) -> None:
        """The prefill's KV cannot be read: recompute the prompt (and the first token's KV) here."""
        self.remote = None
        self.caches_prefix = True
        self._reset_progress()

    def finish(self, reason: FinishReason) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
