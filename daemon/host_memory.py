"""How a rank process holds its host memory: freed heap kept for the next step, the KV cache in huge pages.

1. Paddle's CPU allocator does not cache: each step mallocs its logits, probabilities and verify buffers
   and frees them at its end. With glibc's defaults a freed block above the (dynamic) mmap threshold is
   unmapped and an arena's free top beyond the trim threshold goes back to the kernel, so the next step
   faults every page in again and the kernel zeroes it. A K=3 instance drafting 3 deep at 64 streams took
   1.76 million minor faults in 40 s (~3,400 a step, on its device thread) and served 0.89x of the same
   instance with the thresholds raised.
2. Attention reads each row's KV block by block, and once the prefix cache has cycled the pool a row's
   blocks lie anywhere in it: with 4 KiB pages nearly every block read misses the TLB. The KV tensors
   advised into 2 MiB pages served 1.03x at 64 streams (docs/architecture.md, "Host memory").
Linux/glibc facilities; elsewhere (or with the operator's own malloc settings) nothing changes.
"""

from __future__ import annotations

import ctypes
import os

# NOTE: glibc's mallopt parameters (malloc.h); 32 MiB is the largest mmap threshold it accepts on 64-bit hosts
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 1 << 30  # free heap an arena keeps: what stays is the steps' high-water mark
MALLOC_ENV = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES")
MADV_HUGEPAGE = 14
HUGE_PAGE = 2 << 20


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds for this process (setting either also stops glibc adjusting
    them). False where there is no glibc, or where the operator set malloc's own environment, which wins."""
    libc = _libc()
    if any(name in os.environ for name in MALLOC_ENV) or not hasattr(libc, "mallopt"):
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))


def advise_huge_pages(address: int, num_bytes: int) -> bool:
    """Ask for 2 MiB pages on the whole huge pages inside [address, address + num_bytes); call it before the
    memory is first touched (the pages are chosen when they fault in). False if the kernel refused or the
    range holds no whole huge page."""
    first = -(-address // HUGE_PAGE) * HUGE_PAGE
    end = (address + num_bytes) // HUGE_PAGE * HUGE_PAGE
    libc = _libc()
    if end <= first or not hasattr(libc, "madvise"):
        return False
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc.madvise(first, end - first, MADV_HUGEPAGE) == 0


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)
