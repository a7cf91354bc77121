"""Section 2's finding on the training thread's share of a GPU snapshot: what issuing one costs the host,
launched call by call and as one CUDA graph.

A launch-bound training thread pays for every launch a snapshot issues: seven per staged chunk
(`moevement.storage.device_copy`), about 140 for section 2's 1.26 GB snapshot, which cost about 7 ms per
iteration there (docs/benchmarks.md). Here a layout shaped like it (`bench_moe`'s stacked experts at
W=1: the FP32 weights and both moments of every expert slice and their bf16 compute weights, 2,688
entries, 1.23 GB on the device) is issued `ISSUES` times call by call (`DevicePlan.issue`) and `ISSUES`
times as the trainer's `checkpoint.copy_graph` issues it, one CUDA graph of the same calls replayed
(`moevement.storage.copy_graph.GraphedPlan`). Printed: the host milliseconds per issue of each (median).
Checked: the graph's copy equals the call-by-call one bit for bit, buffer and checksums. Whether
`checkpoint.copy_graph` should be the default is read from these figures and section 2's graphed A/B run.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from benchmarks.gpu_check.report import Check, Section
from benchmarks.gpu_check.runs import Workspace
from moevement.storage.copy_graph import GraphedPlan
from moevement.storage.device_copy import DevicePlan, slot_bytes, staged_chunk_bytes
from moevement.storage.host_memory import HostBuffer
from moevement.storage.private_files import make_private_dirs
from moevement.storage.snapshot import CHUNK_BYTES, STAGING_SLOTS, Entry, layout_of

LAYERS, STACKS, EXPERTS, ROWS, COLS = 7, 3, 32, 256, 512  # bench_moe's MoE layers, w1/w2/w3, experts
ISSUES = 20


def stacked_layout(device: torch.device, rows: int = ROWS) -> tuple[list[Entry], list[torch.Tensor], int]:
    """(entries, sources, bytes) of a W=1 snapshot of stacked experts on `device`: per expert slice its FP32
    weight and two moments, then every slice's bf16 compute weight."""
    master, compute = [], []
    for layer in range(LAYERS):
        for k in range(STACKS):
            weight = torch.randn(EXPERTS, rows, COLS, device=device)
            moments = torch.randn_like(weight), torch.rand_like(weight)
            low = weight.to(torch.bfloat16)
            for e in range(EXPERTS):
                op = f"layers.{layer}.moe.experts.{e}"
                master.append((op, f"w{k}", "master", weight[e], torch.float32))
                master += [(op, f"w{k}.m{i}", "master", m[e], torch.float32) for i, m in enumerate(moments)]
                compute.append((op, f"w{k}", "compute", low[e], torch.bfloat16))
    return layout_of(master + compute)


def host_ms(issue: Callable[[], object], device: torch.device, times: int = ISSUES) -> float:
    """Median host milliseconds of `issue()`, the device idle before each."""
    spent = []
    for _ in range(times):
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        issue()
        spent.append((time.perf_counter() - start) * 1e3)
    torch.cuda.synchronize(device)
    return statistics.median(spent)


def issue_cost(workspace: Workspace, device: torch.device, section: Section) -> list[Check]:
    entries, sources, nbytes = stacked_layout(device)
    host = HostBuffer(make_private_dirs(workspace.host_root, "issue-cost") / "buffer", pin=True)
    try:
        data = host.ensure(nbytes)
        chunk = staged_chunk_bytes(entries, sources, CHUNK_BYTES, device)
        need = slot_bytes(entries, sources, chunk, device)
        slots = torch.zeros(STAGING_SLOTS * need, dtype=torch.uint8, device=device).chunk(STAGING_SLOTS)
        plan = DevicePlan.of(data, entries, sources, chunk, slots)
        stream = torch.cuda.Stream(device)
        eager = host_ms(lambda: plan.issue(stream), device)
        on_host = plan.issue(stream)
        torch.cuda.synchronize(device)
        expected, sums = data.clone(), plan.checksums(on_host)
        graphed = GraphedPlan(plan, torch.cuda.graph_pool_handle())
        graphed.issue(stream)  # call by call: the kernels load
        graphed.issue(stream)  # captured, then replayed
        if graphed.graph is None:
            return [Check("the copy is captured as a CUDA graph", False, "the capture raised (said on stderr)")]
        data.zero_()
        graph_ms = host_ms(lambda: graphed.issue(stream), device)
        same = torch.equal(data, expected) and graphed.checksums(on_host) == sums
    finally:
        host.release()
    section.notes.append(
        f"issue on the training thread: call by call {eager:.2f} ms, one CUDA graph {graph_ms:.2f} ms per "
        f"snapshot ({len(plan.chunks)} chunks, {len(entries)} entries, {nbytes / 1e9:.2f} GB; median of {ISSUES})"
    )
    return [Check("a CUDA graph of the copy equals it bit for bit", same, "buffer and chunk checksums")]
