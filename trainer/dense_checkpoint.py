"""Dense save/resume of the whole training state: safetensors tensors plus JSON metadata.

A checkpoint (format `moevement-dense-v2`) is a directory holding `model.safetensors` (every
parameter by global name), `optim.safetensors` (the AdamW tensors, named `optim.<param>.<key>` as in
`trainer.state`) and `meta.json`: format, step, loss, model shape, tokenizer, the run identity
(`RunIdentity.of_dense`) and a sha256 per file. Nothing is unpickled on load: each file is checked
against its sha256, then read with safetensors, and every rank takes the tensors it holds (its slice
of FSDP-sharded ones), so a checkpoint saved in any parallel layout loads into any other. The old DCP
format (`moevement-dense-v1`, whose `.metadata` is a pickle) is refused without being read. An
imported checkpoint (`python -m models.hf import`) has `"run": null`, an `imported` record, step 0 and
an empty optimizer file: loading it sets the weights and leaves the optimizer fresh.

Saving never deletes or renames anything it did not write. The target must be new, an empty directory
or a checkpoint of this project holding only its own files (`check_save_target`, before training).
Rank 0 writes the consolidated state, one tensor at a time, into a fresh owner-only sibling
`.<name>.tmp-XXXX` marked by `.moevement-partial` (written first), `meta.json` last, then renames it
into place; a replaced checkpoint is first renamed to a fresh `.<name>.old-XXXX`, and only its own files
are deleted. Marked temporaries of the same target whose writer process is gone are removed; nothing
else is.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import socket
import stat
import tempfile
from collections import defaultdict
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open
from torch.distributed.tensor import DTensor, distribute_tensor

from models.args import ModelArgs
from models.experts import stacked_experts
from parallelisms import collectives
from trainer.identity import RunIdentity
from trainer.safetensors_stream import Spec, write_safetensors

FORMAT = "moevement-dense-v2"
OLD_FORMAT = "moevement-dense-v1"
META = "meta.json"
MODEL_FILE = "model.safetensors"
OPTIM_FILE = "optim.safetensors"
PARTIAL = ".moevement-partial"  # marks a temporary directory written by this program
OPTIM_PREFIX = "optim."
KEY = "checkpoint.save_final"


class CheckpointError(RuntimeError):
    """A missing, corrupted, mismatched or unsafe checkpoint or target; the message names the path."""


def _rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _on_rank0(fn: Callable[[], None]) -> None:
    """Run `fn` on rank 0 only; every rank then raises its CheckpointError, if any. Collective."""
    error = None
    if _rank0():
        try:
            fn()
        except CheckpointError as e:
            error = str(e)
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [error]
        collectives.broadcast_object_list(box, src=0)
        error = box[0]
    if error is not None:
        raise CheckpointError(error)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _own_file(path: Path) -> bool:
    """A regular file (not a symlink) owned by this user."""
    try:
        st = path.lstat()
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid()


# ---------------------------------------------------------------- the save target


def _old_checkpoint_files(path: Path, key: str = KEY) -> list[str]:
    """Entries of the existing directory `path` that replacing it deletes ([] if empty).

    Refuses anything but a checkpoint of this project that holds only its own files."""
    try:
        entries = sorted(os.listdir(path))
    except OSError as e:
        raise CheckpointError(f"{key}: cannot read {path} ({e.strerror})") from None
    if not entries:
        return []
    try:
        meta = json.loads((path / META).read_text())
        files, fmt = meta["files"], meta["format"]
    except (OSError, ValueError, RecursionError, TypeError, KeyError):
        files, fmt = {}, None
    if fmt not in (FORMAT, OLD_FORMAT) or not isinstance(files, dict):
        raise CheckpointError(
            f"{key}: {path} is a non-empty directory that is not a MoEvement checkpoint; "
            f"not replaced (choose a new or empty directory)"
        )
    own = {META, PARTIAL, *files}
    foreign = [e for e in entries if e not in own or not _own_file(path / e)]
    if foreign:
        raise CheckpointError(
            f"{key}: checkpoint {path} also holds {', '.join(foreign)}, not written by "
            f"train.py; not replaced (move them or choose another directory)"
        )
    return entries


def _check_target(path: Path, key: str = KEY) -> list[str]:
    """Refuse a target saving would destroy or cannot write; the old checkpoint's files to delete."""
    if path.name in ("", ".", ".."):
        raise CheckpointError(f"{key}: {str(path)!r} does not name a new directory")
    if path.is_symlink():
        raise CheckpointError(f"{key}: {path} is a symlink; refused, never followed")
    if path.exists() and not path.is_dir():
        raise CheckpointError(f"{key}: {path} exists and is not a directory; not replaced")
    old_files = _old_checkpoint_files(path, key) if path.exists() else []
    ancestor = path.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    try:  # the only reliable test (root passes os.access): create and remove a temporary of our own
        os.rmdir(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=ancestor))
    except OSError as e:
        raise CheckpointError(f"{key}: cannot write a checkpoint at {path} ({e.strerror}: {ancestor})") from None
    return old_files


def check_save_target(directory: str) -> None:
    """Refuse, before any training, a save target that is unwritable, a file, a symlink, or a
    non-empty directory other than a checkpoint of this project. Collective."""
    _on_rank0(lambda: _check_target(Path(directory)))


def _stale_temporary(tmp: Path) -> bool:
    """`tmp` carries our marker, is ours, and the process that wrote it (on this host) is gone."""
    try:
        if not (_own_file(tmp / PARTIAL) and tmp.lstat().st_uid == os.getuid()):
            return False
        writer = json.loads((tmp / PARTIAL).read_text())
        pid = int(writer["pid"])
        if writer["host"] != socket.gethostname() or pid <= 0:
            return False
        os.kill(pid, 0)
        return False  # the writer is alive: possibly saving right now
    except ProcessLookupError:
        return True
    except (OSError, ValueError, TypeError, KeyError):
        return False


def _remove_temporary(tmp: Path) -> None:
    """Delete the files we write into a marked temporary directory (the marker last), then the directory."""
    for name in (MODEL_FILE, OPTIM_FILE, f"{META}.tmp", META, PARTIAL):
        if _own_file(tmp / name):
            (tmp / name).unlink()
    with suppress(OSError):
        tmp.rmdir()  # fails, leaving it, if it holds anything else


def _remove_stale_temporaries(path: Path) -> None:
    """Clean up the marked temporaries an interrupted save to `path` left behind (nothing else)."""
    prefix = f".{path.name}.tmp-"
    for entry in os.scandir(path.parent):
        if entry.name.startswith(prefix) and entry.is_dir(follow_symlinks=False) and _stale_temporary(Path(entry.path)):
            _remove_temporary(Path(entry.path))


# ---------------------------------------------------------------- writing


def _write_owner_only(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


@dataclasses.dataclass
class Tensors:
    """What a checkpoint file will hold: each tensor's dtype and shape, and the tensor itself on demand (so
    that a file is written one tensor at a time)."""

    specs: dict[str, Spec]
    tensor_of: Callable[[str], torch.Tensor]

    @classmethod
    def of(cls, tensors: dict[str, torch.Tensor]) -> Tensors:
        return cls({k: (v.dtype, tuple(v.shape)) for k, v in tensors.items()}, tensors.__getitem__)


def _write_new(tmp: Path, model: Tensors, optim: Tensors, meta: dict) -> None:
    """Fill the fresh directory `tmp`: marker first, tensors (owner-only, synced), `meta.json` last."""
    _write_owner_only(tmp / PARTIAL, json.dumps({"pid": os.getpid(), "host": socket.gethostname()}).encode())
    files = {
        MODEL_FILE: write_safetensors(tmp / MODEL_FILE, model.specs, model.tensor_of),
        OPTIM_FILE: write_safetensors(tmp / OPTIM_FILE, optim.specs, optim.tensor_of),
    }
    _write_owner_only(tmp / f"{META}.tmp", json.dumps({**meta, "files": files}, indent=1).encode())
    os.replace(tmp / f"{META}.tmp", tmp / META)


def _swap_in(tmp: Path, path: Path, old_files: list[str]) -> None:
    """Rename the finished `tmp` to `path`; an old checkpoint there goes aside first, then its files go."""
    if not old_files:
        os.rename(tmp, path)  # onto nothing or an empty directory; anything else makes it fail
    else:
        aside = Path(tempfile.mkdtemp(prefix=f".{path.name}.old-", dir=path.parent))
        os.rename(path, aside)  # replaces the empty `aside` we just made
        try:
            os.rename(tmp, path)
        except OSError:
            os.rename(aside, path)
            raise
        for name in old_files:
            with suppress(OSError):
                (aside / name).unlink()
        with suppress(OSError):
            aside.rmdir()
    (path / PARTIAL).unlink()
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_checkpoint(path: Path, model: Tensors, optim: Tensors, meta: dict, key: str = KEY) -> None:
    old_files = _check_target(path, key)  # again: the target may have changed during training
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        _remove_stale_temporaries(path)
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
        _write_new(tmp, model, optim, meta)
        _swap_in(tmp, path, old_files)
    except BaseException as e:  # nothing half-written stays behind, whatever stopped the writing
        if tmp is not None and tmp.exists():
            _remove_temporary(tmp)
        if isinstance(e, OSError):
            raise CheckpointError(f"{key}: cannot save to {path} ({e})") from None
        raise


def save_dense(directory: str, state: dict[str, torch.Tensor] | None, step: int, loss: float, cfg) -> None:
    """Save `state` (`consolidated_training_state`: the whole state on rank 0, None elsewhere) after
    `step` iterations (`loss`: that iteration's) as a checkpoint of the run `cfg`. Collective."""
    meta = {
        "format": FORMAT,
        "step": step,
        "loss": loss,
        "model": dataclasses.asdict(cfg.model),
        "run": RunIdentity.of_dense(cfg).to_json(),
        **({"tokenizer": cfg.data.tokenizer} if cfg.data.tokenizer else {}),
    }
    model = {k: v for k, v in (state or {}).items() if not k.startswith(OPTIM_PREFIX)}
    optim = {k: v for k, v in (state or {}).items() if k.startswith(OPTIM_PREFIX)}
    _on_rank0(lambda: _write_checkpoint(Path(directory), Tensors.of(model), Tensors.of(optim), meta))


def save_imported(directory: str, model: Tensors, model_args: ModelArgs, origin: dict, key: str) -> None:
    """Save the model tensors `model` taken from elsewhere (`origin`: where from) as a step-0 checkpoint with
    no optimizer state and no run identity: `checkpoint.load` starts a run from its weights with a fresh
    optimizer. `key` names the argument in error messages. Single process."""
    meta = {"format": FORMAT, "step": 0, "model": dataclasses.asdict(model_args), "run": None, "imported": origin}
    if origin.get("tokenizer"):
        meta["tokenizer"] = origin["tokenizer"]
    _write_checkpoint(Path(directory), model, Tensors.of({}), meta, key)


def is_imported(meta: dict) -> bool:
    """A checkpoint written by `save_imported` (weights only, from outside any run)."""
    return isinstance(meta.get("imported"), dict) and meta.get("run") is None


# ---------------------------------------------------------------- reading


def open_meta(directory: str) -> dict:
    """The parsed `meta.json` of a checkpoint in this format. The old DCP format is refused unread."""
    path = Path(directory)
    meta_path = path / META
    old = (
        f"{path}: old checkpoint format {OLD_FORMAT} (torch DCP, whose .metadata is a pickle that could run "
        f"code); not loaded: re-save it with this version of train.py"
    )
    if os.path.lexists(path / ".metadata"):
        raise CheckpointError(old)
    if not meta_path.is_file():
        raise CheckpointError(f"{meta_path}: missing; '{directory}' is not a complete MoEvement checkpoint")
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError, RecursionError) as e:
        raise CheckpointError(f"{meta_path}: unreadable ({e})") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{meta_path}: not a JSON object")
    if meta.get("format") == OLD_FORMAT:
        raise CheckpointError(old)
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{meta_path}: format {meta.get('format')!r}, expected {FORMAT!r}")
    files, step = meta.get("files"), meta.get("step")
    if not isinstance(files, dict) or set(files) != {MODEL_FILE, OPTIM_FILE}:
        raise CheckpointError(f"{meta_path}: 'files' must list exactly {MODEL_FILE} and {OPTIM_FILE}")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CheckpointError(f"{meta_path}: 'step' must be an integer >= 0, got {step!r}")
    if not isinstance(meta.get("loss", 0.0), (int, float)) or isinstance(meta.get("loss"), bool):
        raise CheckpointError(f"{meta_path}: 'loss' must be a number, got {meta.get('loss')!r}")
    return meta


def check_model(meta: dict, meta_path: Path, model_args: ModelArgs) -> None:
    """Refuse a checkpoint of another model shape, naming the keys that differ."""
    saved = meta.get("model")
    saved = saved if isinstance(saved, dict) else {}
    differ = [
        f"model.{k} (checkpoint {saved.get(k)!r}, config {v!r})"
        for k, v in dataclasses.asdict(model_args).items()
        if saved.get(k) != v
    ]
    if differ:
        raise CheckpointError(f"{meta_path}: checkpoint is of another model: {', '.join(differ)}")


def verify_files(directory: str, meta: dict, names: tuple[str, ...] = (MODEL_FILE, OPTIM_FILE)) -> None:
    """Check the sha256 of each of `names` against `meta.json` before anything parses them."""
    for name in names:
        file = Path(directory) / name
        if not file.is_file():
            raise CheckpointError(f"{file}: missing from checkpoint")
        if _sha256(file) != meta["files"][name]:
            raise CheckpointError(f"{file}: checksum mismatch (truncated or corrupted)")


def read_meta(directory: str, model_args: ModelArgs) -> dict:
    """Validate a checkpoint directory against this model (format, shape, checksums); its metadata."""
    meta = open_meta(directory)
    check_model(meta, Path(directory) / META, model_args)
    verify_files(directory, meta)
    return meta


class _Reader:
    """Tensors of one safetensors file (no pickle); any failure is a CheckpointError naming the file."""

    def __init__(self, file: Path):
        self.file = file
        try:
            self.handle = safe_open(str(file), framework="pt", device="cpu")
            self.names = set(self.handle.keys())
        except (SafetensorError, OSError) as e:
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise CheckpointError(f"{file}: unreadable ({reason})") from None

    def take(self, names: list[str], like: torch.Tensor) -> torch.Tensor:
        """Tensor `names[0]`, or the stack of `names` (a stacked expert weight: one name per expert), shaped
        like `like`; only this rank's part when `like` is a DTensor."""
        shape = tuple(like.shape) if len(names) == 1 else tuple(like.shape[1:])
        parts = [self._get(name) for name in names]
        for name, part in zip(names, parts, strict=True):
            if tuple(part.shape) != shape:
                raise CheckpointError(f"{self.file}: tensor {name!r} has shape {tuple(part.shape)}, the model {shape}")
        full = parts[0] if len(names) == 1 else torch.stack(parts)
        if isinstance(like, DTensor):
            return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None).to_local()
        return full

    def _get(self, name: str) -> torch.Tensor:
        if name not in self.names:
            raise CheckpointError(f"{self.file}: has no tensor {name!r}")
        try:
            return self.handle.get_tensor(name)
        except SafetensorError as e:
            raise CheckpointError(f"{self.file}: tensor {name!r} unreadable ({e})") from None


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def _stored_names(model: torch.nn.Module) -> list[tuple[torch.nn.Parameter, list[str]]]:
    """(parameter, the names it is stored under) of every parameter: one name per expert of a stacked one."""
    stacked = stacked_experts(model)
    return [(p, stacked[name][1] if name in stacked else [name]) for name, p in model.named_parameters()]


@torch.no_grad()
def load_model(directory: str, model: torch.nn.Module) -> None:
    """Copy every parameter of `model` (plain or DTensor) from the checkpoint's model file, by global name."""
    reader = _Reader(Path(directory) / MODEL_FILE)
    for param, stored in _stored_names(model):
        _local(param).copy_(reader.take(stored, param))


@torch.no_grad()
def _load_optimizer(directory: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Set the AdamW state of every parameter of `model` saved in the checkpoint's optimizer file."""
    reader = _Reader(Path(directory) / OPTIM_FILE)
    keys: dict[str, list[str]] = defaultdict(list)
    for stored in reader.names:
        param_name, _, key = stored[len(OPTIM_PREFIX) :].rpartition(".")
        keys[param_name].append(key)
    for param, names in _stored_names(model):
        state = {}
        for key in sorted(keys.get(names[0], ())):
            stored = [f"{OPTIM_PREFIX}{name}.{key}" for name in names]
            if key == "step":  # AdamW keeps its step count as a CPU scalar (every expert's is the same)
                state[key] = reader.take(stored[:1], torch.empty(()))
            else:
                state[key] = torch.zeros_like(param)
                _local(state[key]).copy_(reader.take(stored, param))
        if state:
            optimizer.state[param] = state


def load_dense(directory: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer, cfg) -> tuple[dict, list[str]]:
    """Validate `directory` against the run `cfg` and load it into this rank's `model` parts and `optimizer`.

    Returns its metadata (step, loss) and the config keys that differ from the saved run's, which is
    empty unless `checkpoint.load_other_config` let them pass (IdentityError otherwise). An imported
    checkpoint (`save_imported`) has no run to compare and no optimizer state: the optimizer stays fresh."""
    meta = open_meta(directory)
    meta_path = Path(directory) / META
    check_model(meta, meta_path, cfg.model)
    identity = RunIdentity.of_dense(cfg)
    if is_imported(meta):  # weights from outside any run: no identity to compare, no optimizer state
        differ = []
    elif cfg.checkpoint.load_other_config:
        differ = identity.mismatch(meta.get("run"), check_job=False)
    else:
        identity.check(meta.get("run"), str(meta_path), check_job=False)
        differ = []
    verify_files(directory, meta)
    load_model(directory, model)
    _load_optimizer(directory, model, optimizer)
    return meta, differ
