"""Every collective of the trainer goes through `parallelisms.collectives`, on groups serving the tensors it
is handed (docs/design/models-and-parallelism.md); a failed communication is told from a bug
by its type or origin, not its wording (`trainer/lifecycle/survival.py`). Real processes over real gloo."""

from __future__ import annotations

import ast
import os
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.emulated_nodes import free_port
from parallelisms import collectives
from parallelisms.distributed import configure_nccl_error_handling, default_backend, init_distributed
from parallelisms.mesh import ParallelismConfig, build_mesh
from tests.helpers import ROOT, module_name, python_files
from trainer.lifecycle.peer_failure import communication_failure, peer_failure

# torch.distributed's collective and point-to-point functions (functional collectives: every function)
COMMUNICATION = frozenset(
    "all_reduce all_gather all_gather_into_tensor all_gather_object gather gather_object scatter "
    "scatter_object_list reduce reduce_scatter reduce_scatter_tensor all_to_all all_to_all_single broadcast "
    "broadcast_object_list send recv isend irecv send_object_list recv_object_list batch_isend_irecv barrier "
    "monitored_barrier all_reduce_coalesced".split()
)
FUNCTIONAL = "torch.distributed._functional_collectives"


def direct_calls(source: str) -> list[tuple[int, str]]:
    """(line, name) of every use of a torch.distributed collective or point-to-point function in `source`:
    `dist.all_reduce`, `torch.distributed.send`, `from torch.distributed import barrier`, any functional one."""
    tree = ast.parse(source)
    aliases = {}  # local name -> the torch module it stands for
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("torch"):
                    aliases[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else "torch"
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch"):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                if (node.module == "torch.distributed" and alias.name in COMMUNICATION) or node.module == FUNCTIONAL:
                    found.append((node.lineno, full))
                aliases[alias.asname or alias.name] = full
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            owner = _dotted(node.value, aliases)
            if (owner == "torch.distributed" and node.attr in COMMUNICATION) or owner == FUNCTIONAL:
                found.append((node.lineno, f"{owner}.{node.attr}"))
    return sorted(found)


def _dotted(node: ast.expr, aliases: dict[str, str]) -> str | None:
    if isinstance(node, ast.Name):
        return aliases.get(node.id)
    if isinstance(node, ast.Attribute):
        owner = _dotted(node.value, aliases)
        return None if owner is None else f"{owner}.{node.attr}"
    return None


def test_no_module_of_the_trainer_calls_torch_distributed_collectives_directly():
    door = ROOT / "parallelisms" / "collectives.py"
    files = [p for p in python_files() if p != door and module_name(p).split(".")[0] != "tests"]
    assert ROOT / "moevement" / "storage" / "replication.py" in files and ROOT / "train.py" in files
    found = [f"{p.relative_to(ROOT)}:{line}: {name}" for p in files for line, name in direct_calls(p.read_text())]
    assert not found, "call these through parallelisms.collectives:\n" + "\n".join(found)
    assert direct_calls(door.read_text()), "the checker finds nothing even in the door itself"


def test_the_checker_sees_every_spelling():
    source = (
        "import torch\nimport torch.distributed as dist\nimport torch.distributed._functional_collectives as fc\n"
        "from torch.distributed import barrier, get_rank\n"
        "dist.all_reduce(t)\ntorch.distributed.send(t, 1)\nfc.wait_tensor(t)\ndist.get_rank()\nx.all_reduce(t)\n"
    )
    assert [name for _, name in direct_calls(source)] == [
        "torch.distributed.barrier",
        "torch.distributed.all_reduce",
        "torch.distributed.send",
        "torch.distributed._functional_collectives.wait_tensor",
    ]


def _spawn(fn, *args) -> None:
    """Run fn(rank, *args) in two processes, each with torchrun's environment."""
    mp.spawn(_as_torchrun_worker, args=(fn, free_port(), *args), nprocs=2)


def _as_torchrun_worker(rank: int, fn, port: int, *args) -> None:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        fn(rank, *args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _unserved_device_is_one_clear_error(rank: int) -> None:
    init_distributed(timeout_s=60, backend="cpu:gloo,cuda:gloo")  # on GPU: cpu:gloo,cuda:nccl
    cuda_only = dist.new_group(backend="cuda:gloo")  # what nccl alone is
    assert collectives.served_devices(cuda_only) == {"cuda"}
    ones = torch.ones(3)
    for call in (
        lambda: collectives.all_reduce(ones, group=cuda_only),
        lambda: collectives.broadcast(ones, src=0, group=cuda_only),
        lambda: collectives.all_gather([torch.empty(3), torch.empty(3)], ones, group=cuda_only),
        lambda: collectives.isend(ones, 1 - rank, group=cuda_only),
        lambda: collectives.barrier(group=cuda_only),
        lambda: collectives.all_gather_object([None, None], rank, group=cuda_only),
    ):
        with pytest.raises(collectives.DeviceNotServed) as raised:
            call()
        assert "a tensor on cpu" in str(raised.value) and "'cuda:gloo' serves cuda only" in str(raised.value)
        assert raised.value.op in str(raised.value) and not peer_failure(raised.value)
    # torch itself, handed the same tensor, names neither the call nor the group
    with pytest.raises(RuntimeError, match="No backend type associated with device type cpu"):
        dist.all_reduce(ones, group=cuda_only)
    # the same calls on a group that serves the CPU go through
    collectives.all_reduce(ones)
    assert ones.tolist() == [2.0, 2.0, 2.0]
    gathered = [None, None]
    collectives.all_gather_object(gathered, rank)
    assert gathered == [0, 1]
    collectives.barrier()


def test_a_tensor_on_a_device_its_group_does_not_serve_is_one_clear_error():
    _spawn(_unserved_device_is_one_clear_error)


def _groups_follow_the_rule(rank: int, backend: str | None, root: str) -> None:
    from moevement.storage.replication import ReplicaStore, start_replication
    from moevement.topology import Topology

    init_distributed(timeout_s=7, backend=backend)
    expected = backend or default_backend("cpu")
    dims = build_mesh(ParallelismConfig(pp=1, dp=2, ep=2), "cpu", timeout_s=7)
    topology = Topology(rank, [0, 0], [0, 1], [0, 0], [[0]])
    replicator = start_replication(
        topology, 1, ReplicaStore(Path(root) / f"rank{rank}"), lambda w: None, None, "normal", 7
    )
    groups = {"default": dist.group.WORLD, **{d: dims.group(d) for d in ("pp", "edp", "ep", "dp")}}
    for name, group in groups.items():
        assert dist.get_backend(group) == expected, name
    groups["replication"] = replicator.group
    for name, group in groups.items():
        assert collectives.served_devices(group) == {"cpu", "cuda"}, name
        if group.size() > 1:  # the bound reaches every backend of every group
            for device in ("cpu", "cuda"):
                assert group._get_backend(torch.device(device)).options._timeout == timedelta(seconds=7), (name, device)
    replicator.close()


@pytest.mark.parametrize("backend", [None, pytest.param("cpu:gloo,cuda:gloo", marks=pytest.mark.slow)])
def test_every_group_of_the_trainer_serves_cpu_and_the_model_device(tmp_path, backend):
    """On this machine (None: gloo) and with the GPU's two-backend shape (gloo standing in for nccl): the
    default group, the mesh's groups and the replication group serve cpu and cuda, with the run's bound."""
    _spawn(_groups_follow_the_rule, backend, str(tmp_path))


def test_the_default_backend_serves_both_devices():
    assert default_backend("cuda") == "cpu:gloo,cuda:nccl"
    assert default_backend("cpu") == "gloo"
    assert set(dist.Backend.backend_capability["gloo"]) == {"cpu", "cuda"}


@pytest.mark.parametrize(
    ("before", "after", "said"),
    [(None, "2", "instead of unset"), ("1", "2", "instead of 1 (TearDown"), ("0", "0", "kept"), ("2", "2", "kept")],
)
def test_nccl_error_handling_keeps_a_survivor_alive(monkeypatch, before, after, said):
    if before is None:
        monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    else:
        monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", before)
    line = configure_nccl_error_handling()
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == after and said in line


def _peer_loss_is_a_communication_failure(rank: int, how: str) -> None:
    init_distributed(timeout_s=2)
    collectives.barrier()
    if rank == 1:
        if how == "hang":
            time.sleep(8)
        os._exit(0)  # gone without a word (as SIGKILL leaves it)
    ones = torch.ones(2)
    with pytest.raises(RuntimeError) as raised:
        for _ in range(50):  # the first may still find rank 1's socket open
            collectives.recv(ones, 1) if how == "hang" else collectives.all_reduce(ones)
    error = raised.value
    assert communication_failure(error) and peer_failure(error), repr(error)
    try:
        raise RuntimeError("snapshot replication failed on rank 0") from error  # as the replication thread's
    except RuntimeError as wrapped:
        assert peer_failure(wrapped) and not communication_failure(wrapped)
    os._exit(0)  # rank 0 leaves the group without a teardown the dead peer cannot join


@pytest.mark.parametrize("how", ["death", pytest.param("hang", marks=pytest.mark.slow)])
def test_a_lost_peer_is_recognised_whatever_the_error_says(how):
    _spawn(_peer_loss_is_a_communication_failure, how)


def test_an_error_that_only_sounds_like_a_lost_peer_is_a_bug():
    for text in ("Connection reset by peer", "Timed out waiting 3000ms for recv operation to complete"):
        try:
            raise RuntimeError(text)
        except RuntimeError as error:
            assert not peer_failure(error)
    assert peer_failure(dist.DistBackendError("watchdog caught collective operation timeout"))
