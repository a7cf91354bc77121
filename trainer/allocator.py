"""Host allocator setting for CPU training: freed large blocks stay in the process for reuse.

glibc serves every block over 32 MB (the ceiling of its adaptive mmap threshold) with a fresh
`mmap` and returns it with `munmap` when freed, so each such allocation faults its pages in again,
one zeroed 4 KiB page at a time. FSDP2 allocates its gradient reduce-scatter buffers anew every
iteration: on `bench_moe` that is about 300,000 page faults and 1-2 s of system time per
iteration, more when other threads of the process (snapshot copies, replication) run, since every
unmap then interrupts them to flush their TLBs. With mmap off and trimming raised, freed blocks go
back to the heap and the next iteration reuses them without faults. Numerics are unaffected.
"""

from __future__ import annotations

import ctypes
import platform

M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # mallopt parameters (malloc.h)
TRIM_THRESHOLD = 2**31 - 1  # keep up to 2 GiB of free heap before returning any to the OS


def reuse_freed_host_memory() -> bool:
    """Make glibc keep freed blocks for reuse (later allocations of this process); False where the
    C library is not glibc, which is then left as it is."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)
    return bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
