"""What a step's rows make of its load, as the speculation policy (speculation.py) reads a plan: its prompt
tokens and emitting rows, the attention it reads (`StepLoad.context`), and the load of a decode step of the
same rows at each depth."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, TypeVar

import numpy as np

from mtpserve.engine.scheduler import SchedulePlan
from mtpserve.engine.spec_cost import StepLoad

_Count = TypeVar("_Count", int, np.ndarray)  # a count, or an array of counts


class PlanLoad(NamedTuple):
    """What the policy and the cost model read of a plan, from one pass over its rows."""

    num_tokens: int  # the target pass's tokens
    prefill_tokens: int  # of them, prompt chunks'
    num_emitting: int  # rows that emit
    context: int  # `StepLoad.context` (0 where not asked for)
    keys: int  # `StepLoad.keys` (0 where not asked for)
    prefix: int  # `StepLoad.prefix` (0 where not asked for)


def plan_load(plan: SchedulePlan, with_context: bool) -> PlanLoad:
    """The plan's tokens, prompt tokens, emitting rows and (`with_context`) what its attention reads: a decode
    window reads the row's KV once (keys: its KV length at the end of it) and its tokens each dot every key
    (pairs: its width times that length); a prompt chunk counts its KV length at the end of it once in
    both (its attention over itself is the mixed curve's), and its pairs over the prompt's earlier positions
    apart (prefix: its width times its start; StepCosts prices them).

    NOTE: one pass, once a step (`Speculation.choose`; `shape` reads it again): three walks of the rows (the
    policy's, the step shape's, the plan's own token sum) cost ~15 us a step at 16 rows on this host, and the
    step's thread waits for the GIL meanwhile.

    NOTE: the attention kernel (ops_ext/paged_attention.cc) reads a row's keys once but dots every query
    with every key. At one row on this host, 224 more positions of context added 0.07 ms to a depth-0
    step's target pass and 0.18-0.20 ms to a depth-2 or depth-3 step's; counted once per row, the profile
    priced a depth-3 step at one row 20% low and the policy drafted 3 where 2 was 7% faster. Counted per
    pair alone, the profile priced a depth-0 step at 64 rows of ~360-token contexts at 0.58 of its time
    and a depth-1 step at 0.84 (spec_curve.Curve.attention_slopes)."""
    num_tokens = prefill = emitting = attended = keys = prefix = 0
    for row in plan.rows:
        width = row.num_tokens
        num_tokens += width
        emitting += row.emits
        if row.is_prefill:
            prefill += width
            attended += row.start_pos + width
            keys += row.start_pos + width
            prefix += width * row.start_pos
        elif with_context:  # NOTE: `pairs`, inline: a call a row was ~15% of the walk at 64 rows
            kv = row.request.num_kv_tokens + width
            attended += width * kv
            keys += kv
    if not with_context:
        return PlanLoad(num_tokens, prefill, emitting, 0, 0, 0)
    return PlanLoad(num_tokens, prefill, emitting, attended, keys, prefix)


def pairs(width: _Count, kv: _Count) -> _Count:
    """A decode window's (query token, key) pairs: `width` tokens after `kv` tokens of KV."""
    return width * (kv + width)


def decode_loads(plan: SchedulePlan, emits: np.ndarray, caps: np.ndarray,
                  floors: np.ndarray) -> Callable[[int], StepLoad]:
    """The load of a decode step of the plan's rows at each depth: every emitting row's window at that
    depth (caps, floors: of the emitting rows), each prompt chunk's context as `context` counts it."""
    chunks = sum(row.start_pos + row.num_tokens for row in plan.rows if row.is_prefill)
    kv = np.array([0 if row.is_prefill else row.request.num_kv_tokens for row in plan.rows])[emits]
    decoding = np.array([not row.is_prefill for row in plan.rows])[emits]

    def load(depth: int) -> StepLoad:
        window = np.maximum(np.minimum(caps, depth), floors) + 1
        context = chunks + int(pairs(window, kv)[decoding].sum())
        keys = chunks + int((kv + window)[decoding].sum())
        return StepLoad(int(window.sum()), len(plan.rows), depth, False, context=context, keys=keys)

    return load
