"""Atomic, resharding checkpoints with torch.distributed.checkpoint (DCP).

A checkpoint is a directory `checkpoints/step-NNNNNNNN/` holding the DCP shards
of the model and optimizer (as `get_state_dict` gives them: keyed by the full
model's parameter names whatever the layout, so any layout loads any other and
DCP reshards), `trainer_state.json` (step, layout, loss scaler), `rng-rank-K.pt`
and a `manifest.json` with the sha256 of every file.

Commit protocol: every rank writes into `.tmp-step-NNNNNNNN/` and hashes the
files it wrote itself (its DCP shard files `__K_*.distcp`, its RNG state), so the
hashing is spread over the ranks; rank 0 gathers the hashes, adds its own files
(DCP's `.metadata`, the trainer state), writes the one manifest, and renames the
directory into place. A crash before the rename leaves only a temporary
directory, which is ignored; a directory whose checksums do not match is skipped
with a warning.

A checkpoint that cannot be written (a full disk, no permission, the directory gone)
stops the run everywhere alike: each stage ends with the ranks agreeing on whether any
of them failed, so no rank waits for a peer that gave up; the temporary directory is
removed, the last committed checkpoint stays the newest, and every rank raises the same
one-line `CheckpointError` naming the step, the directory and the cause. A checkpoints
directory that vanishes during the run is an error, never silently made anew.

A checkpoint is data, never code. Every load refuses anything but tensors and plain
values: the RNG state with `torch.load(weights_only=True)`, the DCP shards through a
reader whose metadata unpickler knows only DCP's own metadata classes and whose
planner reads non-tensor values with `weights_only=True` too (DCP itself would unpickle
both freely). The trainer state is JSON.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import logging
import os
import pickle
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from meshforge.errors import CheckpointError, DataError
from meshforge.fileio import fsync_dir

# the checkpoint's files, manifest and listing are the run directory's (torch-free);
# these names stay importable from here (Fabric, tests)
from meshforge.rundir.checkpoints import (  # noqa: F401
    MANIFEST,
    TRAINER_STATE,
    find_latest_valid,
    hash_own_files,
    list_checkpoints,
    prune,
    step_dir_name,
    verify,
    write_manifest,
)
from meshforge.rundir.paths import confined
from meshforge.train.faults import fail_before_commit

log = logging.getLogger(__name__)


@dataclass
class Snapshot:
    """What a rank contributes to a checkpoint."""

    model: dict[str, Any]  # get_state_dict's model state: full names, DTensors where sharded
    optimizer: dict[str, Any]  # get_state_dict's flattened optimizer state
    trainer_state: dict[str, Any]  # rank 0's is written


class Checkpointer:
    """Saves and resumes a run's model and optimizer state under any layout.

    The state comes from the optimizer container's `get_state_dict` view (one
    entry per parameter of the full model), so a checkpoint written under one
    layout loads under another: DCP reads each rank's slice of every tensor."""

    def __init__(self, root: Path, optimizers: Any, keep: int, warn=log.warning) -> None:
        self.root, self.optimizers, self.keep, self.warn = Path(root), optimizers, keep, warn
        # Made by the first save unless it is there already; from then on it must stay.
        self._root_exists = self.root.is_dir()

    def snapshot(self, trainer_state: dict[str, Any]) -> Snapshot:
        model, optim = self.optimizers.state_dicts()
        return Snapshot(model, optim, trainer_state)

    def save(self, step: int, trainer_state: dict[str, Any]) -> Path:
        """Collective. Raises CheckpointError on every rank if any rank cannot write."""
        snap = self.snapshot(trainer_state)
        final = save(self.root, step, snap, self.keep, create_root=not self._root_exists)
        self._root_exists = True
        return final

    def resume(self, is_main: bool) -> dict[str, Any] | None:
        """Collective: load the newest valid checkpoint into the model and optimizer;
        its trainer state, or None when there is none."""
        found = [None]
        if is_main:
            hit = find_latest_valid(self.root, warn=self.warn)
            found = [str(hit[1]) if hit else None]
        dist.broadcast_object_list(found, src=0)
        if found[0] is None:
            return None
        self.optimizers.ensure_state()
        snap = self.snapshot({})
        state = load(Path(found[0]), snap)
        self.optimizers.load_state_dicts(snap.model, snap.optimizer)
        return state


# -- writing ---------------------------------------------------------------------------------
def save(ckpt_root: Path, step: int, snap: Snapshot, keep: int, create_root: bool = True) -> Path:
    """Collective: every rank calls it. Returns the committed directory, or raises the same
    CheckpointError on every rank when any rank could not write (see the module's doc).
    Without `create_root` the checkpoints directory must exist already."""
    rank = dist.get_rank()
    final = ckpt_root / step_dir_name(step)
    tmp = ckpt_root / f".tmp-{step_dir_name(step)}"

    def fail_all(problem: str | None) -> None:
        if problem is not None:
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(f"cannot write checkpoint {final.name} in {ckpt_root}: {problem}")

    # 1. rank 0 makes the empty temporary directory
    problem = _attempt(_prepare, ckpt_root, tmp, create_root) if rank == 0 else None
    fail_all(problem_from_rank0(problem))

    # 2. every rank writes and hashes its part; DCP's own save is collective
    def extra() -> None:
        _write_durably(tmp / f"rng-rank-{rank}.pt", _tensors_bytes(_rng_state()))
        if rank == 0:
            _write_durably(tmp / TRAINER_STATE, json.dumps(snap.trainer_state, indent=1).encode())

    state = {"model": snap.model, "optim": snap.optimizer}
    merged = write_and_hash(state, tmp, ckpt_root, fail_all, extra)
    # 3. rank 0 commits: manifest, rename into place, prune
    problem = None
    if rank == 0:
        if fail_before_commit(step):
            raise RuntimeError(f"injected fault before committing checkpoint of step {step}")
        problem = _attempt(commit_checkpoint_dir, ckpt_root, tmp, final, step, merged)
        if problem is None:
            prune(ckpt_root, keep)
    fail_all(problem_from_rank0(problem))
    return final


def write_and_hash(
    state: dict[str, Any],
    tmp: Path,
    root: Path,
    fail_all: Callable[[str | None], None],
    extra: Callable[[], None] | None = None,
) -> dict[str, dict[str, Any]]:
    """The middle stage of a commit, collective: every rank writes its DCP shards of
    `state` into `tmp` (and what `extra` writes) and hashes the files it wrote; the
    ranks agree on any failure through `fail_all`. Every rank's hashes, merged."""
    rank = dist.get_rank()
    own: dict[str, Any] = {}
    try:
        dcp.save(state, checkpoint_id=str(tmp))
        if extra is not None:
            extra()
        own = hash_own_files(tmp, rank)
        problem = None
    except (Exception, CheckpointException) as exc:  # DCP's is a BaseException
        problem = why_write_failed(exc, root)
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, (own, problem))
    fail_all(next((p for _, p in parts if p is not None), None))
    merged: dict[str, dict[str, Any]] = {}
    for hashes, _ in parts:
        merged.update(hashes)
    return merged


def problem_from_rank0(problem: str | None) -> str | None:
    """Collective: rank 0's outcome of a stage, on every rank."""
    box = [problem]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _attempt(stage, ckpt_root: Path, *args) -> str | None:
    """Run one stage of writing; None when it worked, else why it did not."""
    try:
        stage(ckpt_root, *args)
        return None
    except Exception as exc:
        return why_write_failed(exc, ckpt_root)


def _prepare(ckpt_root: Path, tmp: Path, create_root: bool) -> None:
    if create_root:
        ckpt_root.mkdir(parents=True, exist_ok=True)
    elif not ckpt_root.is_dir():
        raise FileNotFoundError(errno.ENOENT, "vanished")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()


def commit_checkpoint_dir(
    ckpt_root: Path, tmp: Path, final: Path, step: int, hashed: dict[str, Any]
) -> None:
    """Make TMP (in CKPT_ROOT) the checkpoint FINAL: its manifest (HASHED: the ranks'
    entries), a FINAL already there swapped out whole, the rename into place."""
    write_manifest(tmp, step, hashed)
    aside = None
    if final.exists():  # a previous run reached the same step: swap it out whole
        aside = ckpt_root / f".old-{final.name}"
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(final, aside)
    try:
        os.replace(tmp, final)
    except OSError:
        if aside is not None:
            os.replace(aside, final)
        raise
    fsync_dir(ckpt_root)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


def _write_durably(path: Path, data: bytes) -> None:
    """Python's own file I/O, so a full disk is an OSError naming ENOSPC (torch.save
    straight to a path reports it as an opaque RuntimeError of its zip writer)."""
    with path.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _tensors_bytes(state: dict[str, torch.Tensor]) -> bytes:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def _root_cause(exc: BaseException) -> BaseException:
    """DCP wraps each rank's exception (with its traceback) in a CheckpointException."""
    while isinstance(exc, CheckpointException) and exc.failures:
        first = next(iter(exc.failures.values()))
        exc = first[0] if isinstance(first, tuple) else first
    for linked in (exc.__cause__, exc.__context__):
        if isinstance(linked, OSError) and not isinstance(exc, OSError):
            return linked
    return exc


def why_write_failed(exc: BaseException, ckpt_root: Path) -> str:
    """One line saying why writing failed: the OS's words where the OS refused."""
    exc = _root_cause(exc)
    if isinstance(exc, OSError):
        if exc.errno == errno.ENOENT and not ckpt_root.is_dir():
            return "the directory has vanished (removed while the run was going)"
        return exc.strerror or str(exc)
    return _os_refusal(ckpt_root) or _first_line(exc)


def _os_refusal(ckpt_root: Path, probe_bytes: int = 1 << 20) -> str | None:
    """What the OS says to a small write beside the failed one, if it refuses it.

    torch's zip writer reports a write cut short by a full disk as "unexpected pos N vs
    M" (DCP's shards are written through it); a write of our own names the cause."""
    probe = ckpt_root / f".probe-{os.getpid()}"
    try:
        _write_durably(probe, bytes(probe_bytes))
        return None
    except OSError as exc:
        return exc.strerror or str(exc)
    finally:
        with contextlib.suppress(OSError):
            probe.unlink()


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


# -- reading: data, never code ---------------------------------------------------------------
def load(path: Path, snap: Snapshot) -> dict[str, Any]:
    """Collective: loads shards in place into snap's tensors; returns the trainer state."""
    read_dcp({"model": snap.model, "optim": snap.optimizer}, path)
    try:
        state = json.loads((path / TRAINER_STATE).read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot load checkpoint {path}: {TRAINER_STATE}: {exc}") from None
    rng = path / f"rng-rank-{dist.get_rank()}.pt"
    if rng.exists() and state.get("world_size") == dist.get_world_size():
        _set_rng_state(read_rng_state(rng))
    return state


# What DCP's `.metadata` pickle may name: its own metadata records and the torch types
# they hold (shapes, dtypes, layouts). Anything else (a callable, a class with a
# side-effecting constructor) is refused before it runs.
_DCP_METADATA_CLASSES = {
    *(
        ("torch.distributed.checkpoint.metadata", name)
        for name in (
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "_MEM_FORMAT_ENCODING",
        )
    ),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a layout by name: torch.strided
    ("pathlib", "PosixPath"),  # the checkpoint_id it was saved under
    ("pathlib._local", "PosixPath"),  # Python >= 3.13
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        allowed = (module, name) in _DCP_METADATA_CLASSES or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        )
        if not allowed:
            raise pickle.UnpicklingError(f"{module}.{name} is not checkpoint metadata")
        return super().find_class(module, name)


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader, but its metadata unpickler builds only DCP's metadata records
    (FileSystemReader.read_metadata with `pickle.load` replaced); read once, then kept."""

    _metadata: Metadata | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._metadata is None:
            with self.fs.create_stream(self.fs.concat_path(self.path, ".metadata"), "rb") as f:
                metadata = _MetadataUnpickler(f).load()
            for info in (getattr(metadata, "storage_data", None) or {}).values():
                # the shard files it names stay in the checkpoint (rundir/paths.py)
                confined(Path(self.path), getattr(info, "relative_path", None),
                         f".metadata of {Path(self.path).name}")  # fmt: skip
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            self._metadata = metadata
        return self._metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, reading non-tensor values (optimizer hyper-parameters) as
    plain data: DCP's own reads them with `torch.load(weights_only=False)`."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        data = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            fqn = self.mappings[read_item.dest_index.fqn]
            set_element(self.original_state_dict, fqn, data)
        else:
            self.state_dict[read_item.dest_index.fqn] = data


def read_dcp(state: dict[str, Any], path: Path) -> None:
    """Load DCP shards from PATH into STATE's tensors in place (collective under a process
    group, a plain read without one), refusing anything that is not data."""
    reader = SafeFileSystemReader(str(path))
    try:  # first on its own: DCP would log its failure and retry another file
        reader.read_metadata()
    except DataError:
        raise  # a shard path out of the checkpoint: the one line says which
    except Exception as exc:  # garbage makes an unpickler raise almost anything
        reason = _unreadable(".metadata", exc)
        raise CheckpointError(f"cannot load checkpoint {path}: {reason}") from None
    try:
        dcp.load(state, checkpoint_id=str(path), storage_reader=reader, planner=SafeLoadPlanner())
    except (Exception, CheckpointException) as exc:  # DCP's is a BaseException
        cause = _root_cause(exc)
        reason = (
            _unreadable("a stored value", cause)
            if isinstance(cause, pickle.UnpicklingError)
            else _first_line(cause)
        )
        raise CheckpointError(f"cannot load checkpoint {path}: {reason}") from None


def read_rng_state(path: Path) -> dict[str, torch.Tensor]:
    """A rank's RNG state: a dict of byte tensors, read as data only."""
    where = f"cannot load checkpoint {path.parent}"
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"{where}: {_unreadable(path.name, exc)}") from None
    if not (isinstance(state, dict) and isinstance(state.get("cpu"), torch.Tensor)):
        raise CheckpointError(f"{where}: {path.name} is not an RNG state (a dict of tensors)")
    return state


def _unreadable(what: str, exc: BaseException) -> str:
    """Why WHAT could not be read, in one line; an unpickler's refusal names what the
    file asked for."""
    if isinstance(exc, pickle.UnpicklingError):
        text = str(exc)
        named = re.search(r"GLOBAL ([\w.]+)", text) or re.search(r"^([\w.]+) is not", text)
        asked = f"refers to {named.group(1)}" if named else "holds more"
        return f"{what} {asked}, not only data: refused (checkpoints load as data only)"
    if isinstance(exc, OSError):
        return f"{what}: {exc.strerror or exc}"
    return f"{what}: {_first_line(exc)}"


def _rng_state() -> dict[str, torch.Tensor]:
    out = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state()
    return out


def _set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
