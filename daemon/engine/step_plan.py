"""What the host hands the device for one step, and what the device hands back.

A `StepPlan` is an immutable snapshot built on the host while the previous step still runs. The device
applies it in launch order: first the slot inserts, block-table writes and block copies (staged here, so
inserting a request never waits for the device), then the rows. Decode rows carry no tokens: the device reads the
last sampled token and the drafts of their slot from its own state, which is how tokens sampled at
step N stay device-resident for step N+1.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np

from mtpserve.engine import rng
from mtpserve.engine.request import Request
from mtpserve.engine.scheduler import BlockWrite, SchedulePlan


@dataclasses.dataclass(frozen=True)
class SlotInsert:
    """Everything the device keeps per slot for one request, written when it takes the slot."""

    slot: int
    key: int  # rng.seed_to_key(seed)
    prompt_ids: np.ndarray  # [P] int64, for repetition penalties
    output_ids: np.ndarray  # [O] int64, outputs kept across a preemption (penalties, out_len)
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    presence: float
    frequency: float
    repetition: float
    max_tokens: int
    min_tokens: int
    stop_ids: tuple[int, ...]  # stop token ids, plus EOS unless ignore_eos
    num_logprobs: int  # -1: no logprobs; n >= 0: the emitted token's logprob plus the top n
    # NOTE: a request whose prompt KV came from a prefill instance starts as if it had prefilled here.
    seq_len: int = 0  # tokens with KV already in the slot's blocks
    last_token: int = -1  # its first decode window's first token (with seq_len > 0)
    drafts: np.ndarray | None = None  # [k] int64, that window's drafts
    key_start: int = 0  # the first position whose MTP KV its drafts read (Request.mtp_key_start)

    @classmethod
    def of(cls, request: Request, eos_token_ids: tuple[int, ...]) -> SlotInsert:
        p = request.params
        stops = p.stop_token_ids + (() if p.ignore_eos else eos_token_ids)
        seq_len, last_token, drafts = 0, -1, None
        if request.remote_start is not None:
            seq_len, (last_token, drafts) = request.num_kv_tokens, request.remote_start
        return cls(slot=request.slot_id, key=int(rng.seed_to_key(request.seed)),
                   prompt_ids=request.prompt_ids,
                   output_ids=np.asarray(request.output_ids, dtype=np.int64),
                   temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, min_p=p.min_p,
                   presence=p.presence_penalty, frequency=p.frequency_penalty,
                   repetition=p.repetition_penalty, max_tokens=p.max_tokens,
                   min_tokens=p.min_tokens, stop_ids=tuple(dict.fromkeys(stops)),
                   num_logprobs=-1 if p.logprobs is None else p.logprobs, seq_len=seq_len,
                   last_token=last_token, drafts=drafts, key_start=request.mtp_key_start)


@dataclasses.dataclass(frozen=True)
class StepPlan:
    step_id: int
    inserts: tuple[SlotInsert, ...]
    block_writes: tuple[BlockWrite, ...]
    slots: np.ndarray  # [B] int64
    is_prefill: np.ndarray  # [B] bool
    num_tokens: np.ndarray  # [B] int64: chunk length, or k+1 for a decode window
    start_pos: np.ndarray  # [B] int64: first position of a prefill chunk (decode: unused)
    emits: np.ndarray  # [B] bool: decode windows and last prefill chunks produce tokens
    prefill_ids: np.ndarray  # [sum of prefill chunk lengths] int64, in row order
    # NOTE: MTP depth i at position t reads the token at t+i+1; near a chunk's end that token lies in
    # the next chunk, which only the host has.
    prefill_next_ids: np.ndarray  # [B, k] int64: the k prompt tokens after each prefill chunk, -1 past it
    # NOTE: the speculation policy's choice (spec_policy.py): drafts each row proposes this step for its
    # next window. The MTP proposer runs max(next_num_drafts) depths; 0 everywhere skips it.
    next_num_drafts: np.ndarray  # [B] int64
    # NOTE: (source, destination) KV blocks to copy, in order, before the forward pass (prefix hits)
    block_copies: tuple[tuple[int, int], ...] = ()

    @property
    def num_rows(self) -> int:
        return int(self.slots.shape[0])

    @property
    def num_drafts(self) -> np.ndarray:
        """[B] drafts each row verifies now: a decode window is its last token plus these."""
        return np.where(self.is_prefill, 0, self.num_tokens - 1)

    @property
    def verify_width(self) -> int:
        """Verify rows per plan row: one more than the longest window's drafts."""
        return int(self.num_drafts.max(initial=0)) + 1

    @property
    def num_depths(self) -> int:
        """MTP depths this step runs (the deepest draft any row needs next)."""
        return int(self.next_num_drafts.max(initial=0))

    @classmethod
    def build(cls, step_id: int, plan: SchedulePlan, eos_token_ids: tuple[int, ...],
              num_speculative_tokens: int = 0, next_num_drafts: np.ndarray | None = None) -> StepPlan:
        """`next_num_drafts`: [B] the policy's choice; None: every row drafts num_speculative_tokens."""
        rows = plan.rows
        if next_num_drafts is None:
            next_num_drafts = np.full(len(rows), num_speculative_tokens, np.int64)
        chunks = [r.request.prefill_ids[r.start_pos:r.start_pos + r.num_tokens]
                  for r in rows if r.is_prefill]
        return cls(
            step_id=step_id,
            inserts=tuple(SlotInsert.of(r, eos_token_ids) for r in plan.inserts),
            block_writes=plan.block_writes,
            slots=np.fromiter((r.slot for r in rows), np.int64, len(rows)),
            is_prefill=np.fromiter((r.is_prefill for r in rows), bool, len(rows)),
            num_tokens=np.fromiter((r.num_tokens for r in rows), np.int64, len(rows)),
            start_pos=np.fromiter((r.start_pos for r in rows), np.int64, len(rows)),
            emits=np.fromiter((r.emits for r in rows), bool, len(rows)),
            prefill_ids=np.concatenate(chunks) if chunks else np.zeros(0, np.int64),
            prefill_next_ids=_next_ids(rows, num_speculative_tokens),
            next_num_drafts=next_num_drafts, block_copies=plan.block_copies)


def _next_ids(rows, k: int) -> np.ndarray:
    out = np.full((len(rows), k), -1, np.int64)
    if k:
        for i, r in enumerate(rows):
            if r.is_prefill:
                after = r.request.prefill_ids[r.start_pos + r.num_tokens:r.start_pos + r.num_tokens + k]
                out[i, :after.shape[0]] = after
    return out


class LogprobRows(NamedTuple):
    """Raw (model) logprobs of each emitted token, from the target row that decided it."""

    token_logprobs: np.ndarray  # [B, k+1] float32
    ranks: np.ndarray  # [B, k+1] int64, 1 = most likely
    top_ids: np.ndarray  # [B, k+1, n] int64, n = the widest request of the step
    top_logprobs: np.ndarray  # [B, k+1, n] float32


class StepTiming(NamedTuple):
    """The device thread's seconds on one step, split where the step already waits for the device."""

    target_seconds: float  # everything but drafting: the target pass, verification, logprobs
    draft_seconds: float  # the MTP depths


class StepResult(NamedTuple):
    """Device -> host, one entry per plan row (numpy, copied off the device in one transfer)."""

    step_id: int
    token_ids: np.ndarray  # [B, W] int64: emitted tokens of each row, -1 after the last (W = verify_width)
    num_emitted: np.ndarray  # [B] int64: 0 for non-emitting or invalid rows
    num_accepted: np.ndarray  # [B] int64: drafts the verifier accepted (before stop truncation)
    finish_reason: np.ndarray  # [B] uint8 (request.FinishReason)
    is_valid: np.ndarray  # [B] bool: False for rows of slots that had already stopped on the device
    logprobs: LogprobRows | None = None  # only when some row's request asked for logprobs
    drafts: np.ndarray | None = None  # [B, k] int64: each row's next drafts (MTP on; a PD prefill sends them)
    timing: StepTiming | None = None  # None: not measured (the synthetic runner)
