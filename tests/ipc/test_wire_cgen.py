"""The C++ header ops_ext/mtp_wire.h is generated from ipc/wire.py; these fail when they drift."""

import shutil
import subprocess
from pathlib import Path

import pytest

from mtpserve.ipc import wire, wire_cgen
from mtpserve.ipc.wire_decode import HEADER_STRUCT

HEADER = Path(__file__).resolve().parents[2] / "ops_ext" / "mtp_wire.h"


def test_checked_in_header_equals_the_generated_one():
    assert HEADER.read_text() == wire_cgen.render(), \
        "ops_ext/mtp_wire.h drifted: run python -m mtpserve.ipc.wire_cgen > ops_ext/mtp_wire.h"


def test_check_mode_fails_on_a_changed_constant(monkeypatch):
    assert wire_cgen.main(["--check", str(HEADER)]) == 0
    monkeypatch.setattr(wire, "MAX_TOPK", wire.MAX_TOPK + 1)
    assert wire_cgen.main(["--check", str(HEADER)]) == 1


def test_python_struct_and_numpy_dtype_agree():
    assert HEADER_STRUCT.size == wire.HEADER_SIZE == wire.HEADER_DTYPE.itemsize == 64
    assert wire.field_offset(wire.RING_DTYPE, "write_pos") == 64
    assert wire.field_offset(wire.RING_DTYPE, "read_pos") == 128


@pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler")
def test_header_static_asserts_hold_in_cpp(tmp_path):
    """The generated static_asserts pin every field offset; a compiler checks them."""
    src = tmp_path / "t.cc"
    src.write_text('#include "mtp_wire.h"\nint main() { return 0; }\n')
    subprocess.run(["g++", "-std=c++17", "-fsyntax-only", f"-I{HEADER.parent}", str(src)], check=True)


@pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler")
def test_a_hand_edited_struct_does_not_compile(tmp_path):
    edited = HEADER.read_text().replace("  uint16_t topk;", "  uint32_t topk;")
    (tmp_path / "mtp_wire.h").write_text(edited)
    src = tmp_path / "t.cc"
    src.write_text('#include "mtp_wire.h"\nint main() { return 0; }\n')
    done = subprocess.run(["g++", "-std=c++17", "-fsyntax-only", f"-I{tmp_path}", str(src)],
                          capture_output=True)
    assert done.returncode != 0
