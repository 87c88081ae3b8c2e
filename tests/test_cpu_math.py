"""MKL_DEBUG_CPU_TYPE is set for AMD hosts only, and never over the operator's own value."""

from __future__ import annotations

import os

import pytest

from mtpserve.cpu_math import prefer_avx2_mkl_on_amd

AMD = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse4_2 avx avx2 fma\n"
INTEL = "processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: fpu sse4_2 avx avx2 fma avx512f\n"
OLD_AMD = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse4_2 avx\n"


@pytest.mark.parametrize("cpuinfo, expected", [(AMD, "5"), (INTEL, None), (OLD_AMD, None)])
def test_only_amd_hosts_with_avx2_get_the_avx2_path(tmp_path, monkeypatch, cpuinfo, expected):
    monkeypatch.delenv("MKL_DEBUG_CPU_TYPE", raising=False)
    path = tmp_path / "cpuinfo"
    path.write_text(cpuinfo)
    assert prefer_avx2_mkl_on_amd(str(path)) is (expected is not None)
    assert os.environ.get("MKL_DEBUG_CPU_TYPE") == expected


def test_the_operators_setting_wins(tmp_path, monkeypatch):
    monkeypatch.setenv("MKL_DEBUG_CPU_TYPE", "2")
    path = tmp_path / "cpuinfo"
    path.write_text(AMD)
    assert not prefer_avx2_mkl_on_amd(str(path))
    assert os.environ["MKL_DEBUG_CPU_TYPE"] == "2"


def test_an_unreadable_cpuinfo_changes_nothing(tmp_path, monkeypatch):
    monkeypatch.delenv("MKL_DEBUG_CPU_TYPE", raising=False)
    assert not prefer_avx2_mkl_on_amd(str(tmp_path / "missing"))
