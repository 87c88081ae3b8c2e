"""A step plan survives the trip to the ranks >= 1 unchanged, as plain msgpack (no pickle)."""

from __future__ import annotations

import dataclasses

import msgspec
import numpy as np

from mtpserve.engine.scheduler import BlockWrite
from mtpserve.engine.step_plan import SlotInsert, StepPlan
from mtpserve.engine.tp_plan_codec import decode_plan, encode_plan


def insert(slot: int, seed: int) -> SlotInsert:
    rng = np.random.default_rng(seed)
    return SlotInsert(slot=slot, key=2**63 + seed, prompt_ids=rng.integers(0, 4096, 37),
                      output_ids=rng.integers(0, 4096, seed), temperature=0.7, top_p=0.9, top_k=40,
                      min_p=0.05, presence=0.5, frequency=-0.25, repetition=1.1, max_tokens=128,
                      min_tokens=3, stop_ids=(0, 7), num_logprobs=-1 if seed % 2 else 5)


def plan() -> StepPlan:
    return StepPlan(step_id=41, inserts=(insert(3, 0), insert(5, 3)),
                    block_writes=(BlockWrite(3, 0, (10, 11, 12)), BlockWrite(5, 2, (99,))),
                    slots=np.array([3, 5, 1], np.int64), is_prefill=np.array([True, True, False]),
                    num_tokens=np.array([16, 4, 3], np.int64), start_pos=np.array([0, 16, 0], np.int64),
                    emits=np.array([False, True, True]), prefill_ids=np.arange(20, dtype=np.int64),
                    prefill_next_ids=np.array([[20, 21], [-1, -1], [-1, -1]], np.int64),
                    next_num_drafts=np.array([0, 2, 1], np.int64))


def assert_same(a, b) -> None:
    assert type(a) is type(b)
    if isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a, b)
    elif dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            assert_same(getattr(a, f.name), getattr(b, f.name))
    elif isinstance(a, tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b


def test_round_trip_keeps_every_field_and_dtype():
    original = plan()
    assert_same(decode_plan(encode_plan(original)), original)


def test_empty_plan_round_trips():
    empty = StepPlan(step_id=0, inserts=(), block_writes=(), slots=np.zeros(0, np.int64),
                     is_prefill=np.zeros(0, bool), num_tokens=np.zeros(0, np.int64),
                     start_pos=np.zeros(0, np.int64), emits=np.zeros(0, bool),
                     prefill_ids=np.zeros(0, np.int64), prefill_next_ids=np.zeros((0, 2), np.int64),
                     next_num_drafts=np.zeros(0, np.int64))
    assert_same(decode_plan(encode_plan(empty)), empty)


def test_payload_is_plain_msgpack():
    generic = msgspec.msgpack.decode(encode_plan(plan()))
    assert generic[0] == 41 and len(generic[1]) == 2
