"""The CPU math library's environment, set before Paddle loads it.

Paddle's CPU wheel multiplies matrices with Intel MKL (mklml). On AMD processors MKL picks its generic
code path, not its AVX2 one: on an AMD EPYC host, [3, 256] x [256, 4096] took 320 us instead of
190 us, and the gap grows with the rows of a step (a verify pass has k+1 rows per request). This MKL
release still honours MKL_DEBUG_CPU_TYPE=5 ("use the AVX2 path"). Intel processors are left alone:
there the variable would turn AVX-512 off.
"""

from __future__ import annotations

import os

_CPUINFO = "/proc/cpuinfo"


def prefer_avx2_mkl_on_amd(cpuinfo: str = _CPUINFO) -> bool:
    """Set MKL_DEBUG_CPU_TYPE=5 on AMD hosts with AVX2 unless the operator set it; True if set here."""
    if "MKL_DEBUG_CPU_TYPE" in os.environ or not _is_amd_with_avx2(cpuinfo):
        return False
    os.environ["MKL_DEBUG_CPU_TYPE"] = "5"  # NOTE: children (ranks) inherit it
    return True


def _is_amd_with_avx2(cpuinfo: str) -> bool:
    try:
        with open(cpuinfo, encoding="ascii", errors="replace") as f:
            head = f.read(8192)  # NOTE: the first processor's block says it for all
    except OSError:
        return False
    words = head.split()
    return "AuthenticAMD" in words and "avx2" in words
