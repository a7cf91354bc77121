"""The trainer's one door to `torch.distributed`'s collectives and point-to-point operations.

Every group the trainer creates serves CPU tensors and the model's device (`parallelisms.distributed`,
docs/design/models-and-parallelism.md, "Process groups and collectives"). Each wrapper below takes the arguments of its
`torch.distributed` namesake, checks that `group` (None: the default group) serves the device of every
tensor it is handed and raises `DeviceNotServed` otherwise, naming the operation, the device and the
group's backend (nccl, for one, serves CUDA tensors only, and torch's own error names neither the call
nor the group). Object collectives
and barriers move CPU tensors when their group serves CPU (`_get_object_coll_device` in torch 2.13), so
their group must serve CPU. `wait` waits for the handle of an `isend`/`irecv`: a failed wait, like a failed
call here, is a communication failure (`trainer/lifecycle/survival.py` tells those from bugs by where they were raised).
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

ReduceOp = dist.ReduceOp


class DeviceNotServed(ValueError):
    """A collective or point-to-point operation was handed a tensor on a device its group does not serve."""

    def __init__(self, op: str, device: str, group):
        super().__init__(
            f"{op}: a tensor on {device} was handed to a process group whose backend {dist.get_backend(group)!r} "
            f"serves {', '.join(sorted(served_devices(group)))} only (every group of the trainer must serve cpu "
            "and the model's device: docs/design/models-and-parallelism.md)"
        )
        self.op, self.device = op, device


_SERVED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # group -> its device types (fixed at creation)


def served_devices(group=None) -> frozenset[str]:
    """The device types `group` (None: the default group) has a backend for."""
    group = dist.group.WORLD if group is None else group
    served = _SERVED.get(group)
    if served is None:
        served = _SERVED[group] = frozenset(d.type for d in group._device_types)
    return served


def _require(op: str, group, device_type: str) -> None:
    if group is not dist.GroupMember.NON_GROUP_MEMBER and device_type not in served_devices(group):
        raise DeviceNotServed(op, device_type, group)  # (torch skips a call on a rank outside its group)


def _check(op: str, group, *tensors: torch.Tensor) -> None:
    for tensor in tensors:
        _require(op, group, tensor.device.type)


def all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None, async_op: bool = False):
    _check("all_reduce", group, tensor)
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def broadcast(tensor: torch.Tensor, src: int | None = None, group=None, async_op: bool = False, group_src=None):
    _check("broadcast", group, tensor)
    return dist.broadcast(tensor, src=src, group=group, async_op=async_op, group_src=group_src)


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group=None, async_op: bool = False):
    _check("all_gather", group, tensor, *tensor_list)
    return dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)


def all_to_all_single(
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: list[int] | None = None,
    input_split_sizes: list[int] | None = None,
    group=None,
    async_op: bool = False,
):
    _check("all_to_all_single", group, output, input)
    return dist.all_to_all_single(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)


def all_to_all_single_autograd(
    input: torch.Tensor, output_split_sizes: list[int], input_split_sizes: list[int], group
) -> torch.Tensor:
    """Differentiable all-to-all of rows with uneven splits (backward: the reverse all-to-all); waited."""
    _check("all_to_all_single_autograd", group, input)
    out = funcol.all_to_all_single_autograd(input, output_split_sizes, input_split_sizes, group)
    return funcol.wait_tensor(out)


def send(tensor: torch.Tensor, dst: int | None = None, group=None, tag: int = 0) -> None:
    _check("send", group, tensor)
    dist.send(tensor, dst, group=group, tag=tag)


def recv(tensor: torch.Tensor, src: int | None = None, group=None, tag: int = 0) -> int:
    _check("recv", group, tensor)
    return dist.recv(tensor, src, group=group, tag=tag)


def isend(tensor: torch.Tensor, dst: int | None = None, group=None, tag: int = 0):
    _check("isend", group, tensor)
    return dist.isend(tensor, dst, group=group, tag=tag)


def irecv(tensor: torch.Tensor, src: int | None = None, group=None, tag: int = 0):
    _check("irecv", group, tensor)
    return dist.irecv(tensor, src, group=group, tag=tag)


def wait(work) -> None:
    """Wait for the handle an `isend`, `irecv` or `async_op=True` call returned."""
    work.wait()


def barrier(group=None) -> None:
    _require("barrier", group, "cpu")
    dist.barrier(group=group)


def all_gather_object(object_list: list, obj, group=None) -> None:
    _require("all_gather_object", group, "cpu")
    dist.all_gather_object(object_list, obj, group=group)


def gather_object(obj, object_gather_list: list | None = None, dst: int | None = None, group=None) -> None:
    _require("gather_object", group, "cpu")
    dist.gather_object(obj, object_gather_list, dst=dst, group=group)


def broadcast_object_list(object_list: list, src: int | None = None, group=None) -> None:
    _require("broadcast_object_list", group, "cpu")
    dist.broadcast_object_list(object_list, src=src, group=group)
