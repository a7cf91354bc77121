"""CPU allocator setting: freed large blocks are reused without faulting their pages in again."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

PROBE = """
import resource, statistics, sys, torch
from trainer.allocator import reuse_freed_host_memory
if sys.argv[1] == "reuse":
    assert reuse_freed_host_memory()
def faults_of_one_allocation():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.empty(16 << 20).fill_(1.0)  # 64 MB, above glibc's largest mmap threshold
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
# The heap first grows to its working size: an aligned allocation does not fit in the block just freed, so glibc
# extends the heap until two freed neighbours merge (8 allocations here; how many depends on what else allocates).
for _ in range(24):
    faults_of_one_allocation()
# The median of the steady state: the kernel may fault pages in for reasons of its own (NUMA balancing scans).
print(statistics.median(faults_of_one_allocation() for _ in range(9)))
"""


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
@pytest.mark.slow
def test_freed_blocks_are_reused_without_page_faults():
    def faults(mode: str) -> float:
        out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True)
        return float(out.stdout)

    pages = (64 << 20) // 4096
    assert faults("system") > pages / 2  # glibc maps and unmaps the block each time: every page faults
    assert faults("reuse") < pages / 100
