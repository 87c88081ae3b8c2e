"""host_memory.py on this host's glibc and kernel, each case in a fresh interpreter (malloc settings are
process-wide and cannot be undone)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mtpserve.host_memory import advise_huge_pages

# NOTE: a device thread's pattern: buffers of 1-4 MiB allocated, used and freed step after step
_STEPS = """
import resource, sys, threading
import numpy as np
from mtpserve.host_memory import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "keep" else None
def steps():
    for i in range(200):
        a = np.ones((64 * (1 + i % 4), 4096), np.float32)
        b = np.exp(a) * 2
        del a, b
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
thread = threading.Thread(target=steps)
thread.start()
thread.join()
print(kept, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _run(code: str, *args: str, env: dict[str, str] | None = None) -> list[str]:
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, check=True,
                         env={**os.environ, **(env or {})}, timeout=120)
    return out.stdout.split()


def _faults(mode: str, env: dict[str, str] | None = None) -> tuple[str, int]:
    kept, faults = _run(_STEPS, mode, env=env)
    return kept, int(faults)


def test_freed_buffers_are_reused_instead_of_faulted_in_again() -> None:
    kept, with_kept = _faults("keep")
    _, default = _faults("default")
    assert kept == "True"
    # NOTE: 200 steps of 2-4 buffers of up to 4 MiB: ~70,000 faults with glibc's defaults, a few thousand
    # (the first touch of the high-water mark) kept
    assert with_kept < default / 5, (with_kept, default)


def test_the_operators_malloc_environment_wins() -> None:
    kept, _ = _faults("keep", env={"MALLOC_TRIM_THRESHOLD_": "131072"})
    assert kept == "False"


def test_a_range_without_a_whole_huge_page_is_left_alone() -> None:
    assert not advise_huge_pages(4096, (2 << 20) - 4096)


_KV = """
import re
from mtpserve.model.kv_cache import KVCache
def huge_kib():
    return int(re.search(r"AnonHugePages:\\s+(\\d+)", open("/proc/self/smaps_rollup").read()).group(1))
before = huge_kib()
kv = KVCache.allocate(2, 2047, 16, 4, 64)  # 4 tensors of 8 MiB
print(huge_kib() - before, float(sum(float(t.abs().sum()) for t in (*kv.k, *kv.v))))
"""


def _thp_mode() -> str:
    path = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    return path.read_text().split("[")[1].split("]")[0] if path.exists() else "never"


@pytest.mark.skipif(_thp_mode() == "never", reason="the kernel gives no transparent huge pages here")
def test_the_kv_cache_lies_in_huge_pages_and_starts_zeroed() -> None:
    huge_kib, total = _run(_KV)
    assert int(huge_kib) >= 4 * 6 * 1024, huge_kib  # each 8 MiB tensor holds at least 3 whole 2 MiB pages
    assert float(total) == 0.0
