"""CPU allocator setting: freed large blocks are reused without faulting their pages in again."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

PROBE = """
import resource, sys, torch
from trainer.allocator import reuse_freed_host_memory
if sys.argv[1] == "reuse":
    assert reuse_freed_host_memory()
def faults_per_allocation():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(4):
        torch.empty(16 << 20).fill_(1.0)  # 64 MB, above glibc's largest mmap threshold
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 4
for _ in range(3):  # the heap grows to its working size first
    faults_per_allocation()
print(faults_per_allocation())
"""


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_freed_blocks_are_reused_without_page_faults():
    def faults(mode: str) -> float:
        out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True)
        return float(out.stdout)

    pages = (64 << 20) // 4096
    assert faults("system") > pages / 2  # glibc maps and unmaps the block each time: every page faults
    assert faults("reuse") < pages / 100
