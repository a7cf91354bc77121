"""One rank's part of a sparse window, re-laid from another data-parallel layout (docs/design/lifecycle/elastic.md).

An elastic job (`parallelism.elastic`) keeps `pp` and `ep` and changes `dp` when it comes back on fewer or
more nodes (`parallelisms.elastic`). FSDP2 cuts dim 0 of a tensor (of a routed expert's slice: its stacked
parameter's dim 1) into chunks of ceil(n / size) rows, chunk k on member k of the group that shards it: the
stage's `dp` ranks, or for a routed expert the `edp` ranks of its expert-parallel rank, which stays. Buffers
and step counters are whole on every rank. A new rank's rows of a tensor are therefore the overlapping rows of
the old members' entries, in order, and nothing else in a snapshot depends on the layout but the rank's
coordinates in its `meta`. Every count is checked against the model this rank built: a window that does not
cut the way the rule says is refused, never guessed at.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from moevement.operators import Operator
from moevement.storage.snapshot import SnapshotError, SnapshotHeader, layout_of

Slot = tuple[SnapshotHeader, dict]  # one snapshot: its header and {(role, name): tensor}


@dataclass(frozen=True)
class DataParallel:
    """A stage's data-parallel layout: `dp` ranks, carved into `ep` expert-parallel ranks
    (dp_rank = edp_rank * ep + ep_rank, `parallelisms.mesh`)."""

    dp: int
    ep: int

    def group(self, expert: bool) -> int:
        """The size of the group that shards a tensor: `edp` for a routed expert's, `dp` otherwise."""
        return self.dp // self.ep if expert else self.dp

    def member(self, dp_rank: int, expert: bool) -> int:
        """`dp_rank`'s index in the group that shards a tensor."""
        return dp_rank // self.ep if expert else dp_rank

    def dp_rank(self, member: int, ep_rank: int, expert: bool) -> int:
        """The data-parallel rank of a group's `member` (for an expert: of expert-parallel rank `ep_rank`)."""
        return member * self.ep + ep_rank if expert else member


def chunk_rows(n: int, size: int, member: int) -> range:
    """The rows of an `n`-row tensor that member `member` of `size` holds (`torch.chunk`, as FSDP2 cuts)."""
    per = -(-n // size)
    low = min(member * per, n)
    return range(low, min(low + per, n))


@dataclass(frozen=True)
class Sharded:
    """A tensor cut over a data-parallel group: its rows in all, whether a routed expert's group cuts it, and
    how many of them this rank holds (what its model says)."""

    rows: int
    expert: bool
    local_rows: int


def sharding_of(ops: Iterable[Operator]) -> dict[str, Sharded]:
    """{parameter name: Sharded} of this rank's operators: a stacked parameter's slice is cut along the
    parameter's dim 1 (`parallelisms.fsdp`), any other parameter along dim 0."""
    out = {}
    for op in ops:
        for name, ref in op.params.items():
            rows = ref.param.shape[0 if ref.index is None else 1]
            local = ref.local()
            out[name] = Sharded(rows, op.kind == "expert", local.shape[0] if local.dim() else 0)
    return out


def _parameter_of(entry_name: str) -> str:
    """The parameter whose rows an entry holds: itself, or for optimizer state `optim.<param>.<key>` the param."""
    return entry_name.removeprefix("optim.").rsplit(".", 1)[0] if entry_name.startswith("optim.") else entry_name


@dataclass(frozen=True)
class NewPlace:
    """Where a rank of the new layout sits: its stage's data-parallel layout and its coordinates."""

    layout: DataParallel
    dp_rank: int
    rank: int

    @property
    def ep_rank(self) -> int:
        return self.dp_rank % self.layout.ep


def old_ranks_needed(sharding: Mapping[str, Sharded], new: NewPlace, old: DataParallel) -> list[int]:
    """The old data-parallel ranks of this rank's stage whose rows it needs, the first of them the one whose
    headers and whole tensors it takes (the old rank of its own expert-parallel rank at index 0)."""
    needed = {new.ep_rank}
    for s in sharding.values():
        mine = chunk_rows(s.rows, new.layout.group(s.expert), new.layout.member(new.dp_rank, s.expert))
        for member in range(old.group(s.expert)):
            theirs = chunk_rows(s.rows, old.group(s.expert), member)
            if max(mine.start, theirs.start) < min(mine.stop, theirs.stop):
                needed.add(old.dp_rank(member, new.ep_rank, s.expert))
    return [new.ep_rank, *sorted(needed - {new.ep_rank})]


def relaid_window(
    windows: Mapping[int, list[Slot]], sharding: Mapping[str, Sharded], new: NewPlace, old: DataParallel, meta: dict
) -> list[Slot]:
    """This rank's window, re-laid from the old ranks' (`windows`: {old dp_rank: slots}, holding at least
    `old_ranks_needed`), its headers naming this rank and carrying `meta` (its coordinates and run)."""
    reference = windows[new.ep_rank]
    out = []
    for slot, (header, tensors) in enumerate(reference):
        for dp_rank, slots in windows.items():
            _check_same_slot(header, slots[slot][0], dp_rank, same_operators=dp_rank % old.ep == new.ep_rank)
        items, slot_tensors = [], {r: w[slot][1] for r, w in windows.items()}
        for entry in header.entries:
            key = (entry.role, entry.name)
            sharded = sharding.get(_parameter_of(entry.name))
            whole = sharded is None or not entry.shape
            tensor = tensors[key] if whole else _rows(key, sharded, slot_tensors, new, old)
            items.append((entry.op, entry.name, entry.role, tensor, tensor.dtype))
        entries, sources, nbytes = layout_of(items)
        relaid = SnapshotHeader(
            header.iteration, header.window_start, header.slot, header.window, new.rank,
            list(header.active), list(header.frozen), entries, nbytes, {**header.meta, **meta},
        )  # fmt: skip
        out.append((relaid, {(e.role, e.name): t for e, t in zip(entries, sources, strict=True)}))
    return out


def _check_same_slot(mine: SnapshotHeader, theirs: SnapshotHeader, dp_rank: int, same_operators: bool) -> None:
    """The old ranks' snapshots of a slot hold one iteration (and, on one expert-parallel rank, one split of
    the operators into active and frozen): anything else cannot be re-laid."""
    if (theirs.iteration, theirs.window_start) != (mine.iteration, mine.window_start) or (
        same_operators and (theirs.active, theirs.frozen) != (mine.active, mine.frozen)
    ):
        raise SnapshotError(
            f"old dp rank {dp_rank}'s snapshot of slot {mine.slot} (iteration {theirs.iteration}) does not match "
            f"its peers' (iteration {mine.iteration}): the window cannot be re-laid"
        )


def _rows(
    key: tuple[str, str], sharded: Sharded, tensors: Mapping[int, dict], new: NewPlace, old: DataParallel
) -> torch.Tensor:
    """This rank's rows of the entry `key`, copied out of the old members' entries that hold them."""
    expert, n = sharded.expert, sharded.rows
    mine = chunk_rows(n, new.layout.group(expert), new.layout.member(new.dp_rank, expert))
    if len(mine) != sharded.local_rows:
        raise SnapshotError(
            f"{key[1]}: this rank holds {sharded.local_rows} of its {n} rows, not the {len(mine)} that FSDP's "
            "chunking gives: the window cannot be re-laid into this model"
        )
    parts = []
    for member in range(old.group(expert)):
        theirs = chunk_rows(n, old.group(expert), member)
        low, high = max(mine.start, theirs.start), min(mine.stop, theirs.stop)
        if low >= high:
            continue
        dp_rank = old.dp_rank(member, new.ep_rank, expert)
        tensor = tensors[dp_rank].get(key)
        if tensor is None or tensor.shape[0] != len(theirs):
            raise SnapshotError(
                f"old dp rank {dp_rank}'s {key[0]} entry {key[1]} "
                f"{'is missing' if tensor is None else f'has {tensor.shape[0]} rows, not {len(theirs)}'}: "
                f"the window is not laid out as dp={old.dp} ep={old.ep} says"
            )
        parts.append(tensor[low - theirs.start : high - theirs.start])
    if not parts:  # this rank holds none of the rows (FSDP's trailing empty chunks)
        like = tensors[new.ep_rank][key]
        return like.new_empty((0, *like.shape[1:]))
    return torch.cat(parts)
