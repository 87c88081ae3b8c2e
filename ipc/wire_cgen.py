"""Render ops_ext/mtp_wire.h, the C++ mirror of ipc/wire.py.

    python -m mtpserve.ipc.wire_cgen > ops_ext/mtp_wire.h      # regenerate after editing wire.py
    python -m mtpserve.ipc.wire_cgen --check ops_ext/mtp_wire.h  # exit 1 when the two drifted

tests/ipc/test_wire_cgen.py runs the check, so a hand edit on either side fails the test run.
"""

from __future__ import annotations

import enum
import sys
from pathlib import Path

import numpy as np

from mtpserve.ipc import wire

_CTYPES = {"u1": "uint8_t", "u2": "uint16_t", "u4": "uint32_t", "u8": "uint64_t",
           "i1": "int8_t", "i2": "int16_t", "i4": "int32_t", "i8": "int64_t", "f4": "float"}


def _ctype(dtype: str) -> str:
    return _CTYPES[np.dtype(dtype).str[1:]]


def _struct(name: str, dtype: np.dtype, fields: tuple[tuple[str, str], ...]) -> list[str]:
    lines = [f"struct {name} {{"]
    lines += [f"  {_ctype(t)} {n};" for n, t in fields]
    lines += ["};", f"static_assert(sizeof({name}) == {dtype.itemsize}, \"{name} size\");"]
    lines += [f"static_assert(offsetof({name}, {n}) == {wire.field_offset(dtype, n)}, \"{name}.{n}\");"
              for n, _ in fields]
    return lines


def _enum(cls: type[enum.IntEnum] | type[enum.IntFlag], prefix: str) -> list[str]:
    return [f"constexpr int k{prefix}{str(m.name).title().replace('_', '')} = {int(m.value)};"
            for m in cls]


def _constants() -> list[str]:
    ints = {"kMagic": wire.MAGIC, "kVersion": wire.VERSION, "kRingMagic": wire.RING_MAGIC,
            "kRingVersion": wire.RING_VERSION, "kSectionAlign": wire.SECTION_ALIGN,
            "kKnownFlags": wire.KNOWN_FLAGS, "kMaxReqs": wire.MAX_REQS,
            "kMaxTokensPerReq": wire.MAX_TOKENS_PER_REQ, "kMaxTopk": wire.MAX_TOPK,
            "kMaxDraftWidth": wire.MAX_DRAFT_WIDTH, "kMaxControlMessage": wire.MAX_CONTROL_MESSAGE,
            "kMaxPayload": wire.MAX_PAYLOAD, "kHeaderSize": wire.HEADER_SIZE,
            "kRingHeaderBytes": wire.RING_HEADER_BYTES, "kControlPrefix": wire.CONTROL_PREFIX}
    return [f"constexpr uint32_t {k} = 0x{v:X}u;" for k, v in ints.items()]


def _sections() -> list[str]:
    lines = ["struct SectionSpec { const char* name; uint32_t elem_size; int count_kind; "
             "bool needs_logprobs; };",
             f"constexpr int kNumSections = {len(wire.SECTIONS)};",
             "constexpr SectionSpec kSections[kNumSections] = {"]
    for s in wire.SECTIONS:
        size = np.dtype(s.dtype).itemsize
        lines.append(f"    {{\"{s.name}\", {size}, {int(s.count_kind)}, "
                     f"{'true' if s.needs_logprobs else 'false'}}},")
    lines.append("};")
    lines += [f"constexpr int kSection{s.name.title().replace('_', '')} = {i};"
              for i, s in enumerate(wire.SECTIONS)]
    return lines


def render() -> str:
    body = ["// GENERATED from ipc/wire.py by `python -m mtpserve.ipc.wire_cgen`. Do not edit by hand:",
            "// tests/ipc/test_wire_cgen.py fails when this file and ipc/wire.py drift.",
            "#pragma once", "#include <cstddef>", "#include <cstdint>", "",
            "namespace mtp_wire {", ""]
    body += _constants() + [""]
    for cls, prefix in ((wire.Kind, "Kind"), (wire.Flag, "Flag"), (wire.Finish, "Finish"),
                        (wire.ControlCode, "Control"), (wire.Transport, "Transport"),
                        (wire.CountKind, "Count")):
        body += _enum(cls, prefix)
    body += [""] + _struct("FrameHeader", wire.HEADER_DTYPE, wire.HEADER_FIELDS)
    body += [""] + _struct("RingHeader", wire.RING_DTYPE, wire.RING_FIELDS)
    body += [""] + _sections() + ["", "}  // namespace mtp_wire", ""]
    return "\n".join(body)


def main(argv: list[str]) -> int:
    if argv[:1] == ["--check"]:
        return 0 if Path(argv[1]).read_text() == render() else 1
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
