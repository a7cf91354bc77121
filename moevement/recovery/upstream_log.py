"""Upstream logging at pipeline boundaries (docs/design/overview.md, docs/design/recovery.md).

Every stage logs, at the sender, what it sends across a pipeline boundary, tagged
(iteration, stage, micro-batch):
  - "act": the activations stage s sends downstream to s+1 (its output, s not last);
  - "grad": the gradients stage s sends upstream to s-1 (its input's gradient, s not first).
A failed stage s replays alone from the "act" log of s-1 and the "grad" log of s+1.

Entries live in host memory (on GPU they are copied on a side stream into pinned memory, off
the critical path) from the first iteration of the oldest checkpoint recovery may roll back to,
and are garbage-collected with it. The same hooks count stage forward/backward passes, so a
recovery can show that healthy stages executed nothing.
"""

from __future__ import annotations

import torch
from torch import nn

from moevement.storage.cpu_cost import measure

Key = tuple[str, int, int, int]  # (kind, iteration, stage, micro-batch)


class UpstreamLog:
    def __init__(self, parts: list[nn.Module], stage_ids: list[int], n_stages: int):
        self.n_stages = n_stages
        self.entries: dict[Key, torch.Tensor] = {}
        self.iteration = 0
        self.calls = dict.fromkeys(stage_ids, 0)
        self.forwards = self.backwards = 0
        self.stream = None
        for part, stage in zip(parts, stage_ids):
            part.register_forward_hook(
                lambda module, args, out, stage=stage: self._on_forward(module, stage, args, out)
            )

    def begin(self, iteration: int) -> None:
        """Iteration `iteration`'s micro-batches are about to run (again, in a replay)."""
        self.iteration = iteration
        self.calls = dict.fromkeys(self.calls, 0)
        if self.stream is not None:
            self.stream.synchronize()  # the previous iteration's host copies are complete

    def get(self, kind: str, iteration: int, stage: int, micro: int) -> torch.Tensor:
        try:
            return self.entries[(kind, iteration, stage, micro)]
        except KeyError:
            raise KeyError(
                f"upstream log has no {kind} of stage {stage} for iteration {iteration} micro-batch {micro}"
            ) from None

    def put(self, kind: str, iteration: int, stage: int, micro: int, tensor: torch.Tensor) -> None:
        self.entries[(kind, iteration, stage, micro)] = tensor

    def collect_garbage(self, keep_from: int) -> None:
        """Drop entries of iterations before `keep_from` (no checkpoint can roll back before it)."""
        for key in [k for k in self.entries if k[1] < keep_from]:
            del self.entries[key]

    def wipe(self) -> None:
        """This rank failed: its logs are gone (overwritten, then dropped)."""
        for tensor in self.entries.values():
            tensor.fill_(float("nan")) if tensor.is_floating_point() else tensor.zero_()
        self.entries.clear()

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.entries.values())

    def work(self) -> tuple[int, int]:
        """(stage forwards, stage backwards) executed on this rank so far (training mode)."""
        return self.forwards, self.backwards

    def _on_forward(self, module: nn.Module, stage: int, args: tuple, out: torch.Tensor) -> None:
        if not module.training:
            return  # validation passes are not part of training
        micro, iteration = self.calls[stage], self.iteration
        self.calls[stage] += 1
        self.forwards += 1
        if out.requires_grad:
            out.register_hook(self._count_backward)
        if stage != self.n_stages - 1:
            with measure("upstream_log"):
                self.put("act", iteration, stage, micro, self._to_host(out))
        x = args[0]
        if stage != 0 and isinstance(x, torch.Tensor) and x.requires_grad:
            # One-shot: the pipeline reuses its receive buffers across iterations, and a hook left
            # on one would overwrite this iteration's entry at every later backward.
            def log_grad(grad: torch.Tensor) -> None:
                handle.remove()
                with measure("upstream_log"):
                    self.put("grad", iteration, stage, micro, self._to_host(grad))

            handle = x.register_hook(log_grad)

    def _count_backward(self, _grad: torch.Tensor) -> None:
        self.backwards += 1

    def _to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host copy of `tensor` (the original may be reused by the pipeline's buffers)."""
        tensor = tensor.detach()
        if tensor.device.type != "cuda":
            return tensor.clone()
        if self.stream is None:
            self.stream = torch.cuda.Stream(tensor.device)
        self.stream.wait_stream(torch.cuda.current_stream(tensor.device))
        with torch.cuda.stream(self.stream):
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            host.copy_(tensor, non_blocking=True)
            tensor.record_stream(self.stream)
        return host
