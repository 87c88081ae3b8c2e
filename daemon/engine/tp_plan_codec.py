"""A StepPlan as bytes for the ranks >= 1: msgspec msgpack (no pickle), arrays as raw buffers.

The plan already is a delta (slot inserts, block-table writes, per-row info), so encoding all of it
sends only what changed since the previous step.
"""

from __future__ import annotations

import dataclasses
import typing

import msgspec
import numpy as np

from mtpserve.engine.scheduler import BlockWrite
from mtpserve.engine.step_plan import SlotInsert, StepPlan


class WireArray(msgspec.Struct, array_like=True, frozen=True):
    dtype: str
    shape: tuple[int, ...]
    data: bytes

    @classmethod
    def of(cls, a: np.ndarray) -> WireArray:
        a = np.ascontiguousarray(a)
        return cls(a.dtype.str, a.shape, a.tobytes())

    def array(self) -> np.ndarray:
        return np.frombuffer(self.data, np.dtype(self.dtype)).reshape(self.shape).copy()


# NOTE: the plain-number fields of SlotInsert travel by name; decoding restores each one's declared type
# (int or float) from SlotInsert itself, so the wire form cannot drift from it.
_SLOT_TYPES: dict[str, type] = typing.get_type_hints(SlotInsert)
_INSERT_ARRAYS = ("prompt_ids", "output_ids", "stop_ids", "drafts")
_SCALARS = tuple(f.name for f in dataclasses.fields(SlotInsert) if f.name not in _INSERT_ARRAYS)


class WireInsert(msgspec.Struct, array_like=True, frozen=True):
    scalars: dict[str, int | float]  # every SlotInsert field that is a plain number
    prompt_ids: WireArray
    output_ids: WireArray
    stop_ids: tuple[int, ...]
    drafts: WireArray | None = None  # a prefilled request's first drafts


class WirePlan(msgspec.Struct, array_like=True, frozen=True):
    step_id: int
    inserts: tuple[WireInsert, ...]
    block_writes: tuple[tuple[int, int, tuple[int, ...]], ...]  # (slot, first_col, block_ids)
    arrays: dict[str, WireArray]  # the per-row StepPlan fields
    block_copies: tuple[tuple[int, int], ...] = ()  # (source, destination)


_ARRAY_FIELDS = ("slots", "is_prefill", "num_tokens", "start_pos", "emits", "prefill_ids",
                 "prefill_next_ids", "next_num_drafts")
_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(WirePlan)


def encode_plan(plan: StepPlan) -> bytes:
    return _ENCODER.encode(WirePlan(
        step_id=plan.step_id, inserts=tuple(_wire_insert(i) for i in plan.inserts),
        block_writes=tuple((w.slot, w.first_col, tuple(w.block_ids)) for w in plan.block_writes),
        arrays={name: WireArray.of(getattr(plan, name)) for name in _ARRAY_FIELDS},
        block_copies=plan.block_copies))


def decode_plan(data: bytes | memoryview) -> StepPlan:
    wire = _DECODER.decode(data)
    return StepPlan(step_id=wire.step_id, inserts=tuple(_slot_insert(i) for i in wire.inserts),
                    block_writes=tuple(BlockWrite(s, c, tuple(b)) for s, c, b in wire.block_writes),
                    block_copies=tuple((src, dst) for src, dst in wire.block_copies),
                    **{name: a.array() for name, a in wire.arrays.items()})


def _wire_insert(ins: SlotInsert) -> WireInsert:
    scalars = {name: getattr(ins, name) for name in _SCALARS}
    drafts = None if ins.drafts is None else WireArray.of(ins.drafts)
    return WireInsert(scalars, WireArray.of(ins.prompt_ids), WireArray.of(ins.output_ids),
                      tuple(ins.stop_ids), drafts)


def _slot_insert(wire: WireInsert) -> SlotInsert:
    return SlotInsert(prompt_ids=wire.prompt_ids.array(), output_ids=wire.output_ids.array(),
                      stop_ids=wire.stop_ids, drafts=None if wire.drafts is None else wire.drafts.array(),
                      **_typed_scalars(wire.scalars))


def _typed_scalars(scalars: dict[str, int | float]) -> dict[str, typing.Any]:
    if set(scalars) != set(_SCALARS):
        raise ValueError(f"plan insert scalars {sorted(scalars)} are not SlotInsert's {sorted(_SCALARS)}")
    return {name: _SLOT_TYPES[name](value) for name, value in scalars.items()}
