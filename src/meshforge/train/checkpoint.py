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
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from meshforge.errors import CheckpointError
from meshforge.train.faults import fail_before_commit

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
TRAINER_STATE = "trainer_state.json"


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _file_entry(path: Path) -> dict[str, Any]:
    return {"sha256": _sha256(path), "bytes": path.stat().st_size}


def hash_own_files(directory: Path, rank: int) -> dict[str, dict[str, Any]]:
    """Entries for the files this rank wrote: its DCP shards and its RNG state."""
    own = [*directory.glob(f"__{rank}_*"), directory / f"rng-rank-{rank}.pt"]
    return {p.name: _file_entry(p) for p in own if p.is_file()}


def write_manifest(
    directory: Path, step: int, hashed: dict[str, dict[str, Any]] | None = None
) -> dict[str, Any]:
    """The manifest over every file of `directory`; `hashed` holds entries the ranks
    already computed, the rest are hashed here."""
    hashed = dict(hashed or {})
    files = sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST)
    entries = {}
    for p in files:
        rel = str(p.relative_to(directory))
        entries[rel] = hashed.get(rel) or _file_entry(p)
    manifest = {"format": "meshforge-checkpoint-v1", "step": step, "files": entries}
    tmp = directory / (MANIFEST + ".tmp")
    with tmp.open("w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / MANIFEST)
    return manifest


def verify(directory: Path) -> str | None:
    """None when the checkpoint is complete and intact, else the reason it is not."""
    mpath = directory / MANIFEST
    if not mpath.exists():
        return "no manifest"
    try:
        manifest = json.loads(mpath.read_text())
        files = manifest["files"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return "manifest is not valid JSON"
    for rel, meta in files.items():
        p = directory / rel
        if not p.exists():
            return f"missing file {rel}"
        if p.stat().st_size != meta["bytes"] or _sha256(p) != meta["sha256"]:
            return f"checksum mismatch in {rel}"
    return None


def list_checkpoints(ckpt_root: Path) -> list[tuple[int, Path]]:
    out = []
    if ckpt_root.is_dir():
        for p in ckpt_root.iterdir():
            if p.is_dir() and p.name.startswith("step-"):
                try:
                    out.append((int(p.name[5:]), p))
                except ValueError:
                    continue
    return sorted(out)


def find_latest_valid(ckpt_root: Path, warn=log.warning) -> tuple[int, Path] | None:
    for step, path in reversed(list_checkpoints(ckpt_root)):
        problem = verify(path)
        if problem is None:
            return step, path
        warn(f"skipping checkpoint {path.name}: {problem}")
    return None


def prune(ckpt_root: Path, keep: int) -> None:
    for _, path in list_checkpoints(ckpt_root)[:-keep]:
        shutil.rmtree(path, ignore_errors=True)


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

    def snapshot(self, trainer_state: dict[str, Any]) -> Snapshot:
        model, optim = self.optimizers.state_dicts()
        return Snapshot(model, optim, trainer_state)

    def save(self, step: int, trainer_state: dict[str, Any]) -> Path:
        """Collective."""
        return save(self.root, step, self.snapshot(trainer_state), self.keep)

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


def save(ckpt_root: Path, step: int, snap: Snapshot, keep: int) -> Path:
    """Collective: every rank calls it. Returns the committed directory."""
    rank = dist.get_rank()
    final = ckpt_root / step_dir_name(step)
    tmp = ckpt_root / f".tmp-{step_dir_name(step)}"
    if rank == 0:
        ckpt_root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    dist.barrier()
    dcp.save({"model": snap.model, "optim": snap.optimizer}, checkpoint_id=str(tmp))
    torch.save(_rng_state(), tmp / f"rng-rank-{rank}.pt")
    if rank == 0:
        (tmp / TRAINER_STATE).write_text(json.dumps(snap.trainer_state, indent=1))
    own = hash_own_files(tmp, rank)
    hashes: list[dict[str, Any] | None] = [None] * dist.get_world_size()
    dist.gather_object(own, hashes if rank == 0 else None, dst=0)
    if rank == 0:
        if fail_before_commit(step):
            raise RuntimeError(f"injected fault before committing checkpoint of step {step}")
        merged: dict[str, Any] = {}
        for h in hashes:
            merged.update(h or {})
        write_manifest(tmp, step, merged)
        if final.exists():  # a previous run reached the same step; replace it whole
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(ckpt_root)
        prune(ckpt_root, keep)
    dist.barrier()
    return final


def load(path: Path, snap: Snapshot) -> dict[str, Any]:
    """Collective: loads shards in place into snap's tensors; returns the trainer state."""
    try:
        dcp.load({"model": snap.model, "optim": snap.optimizer}, checkpoint_id=str(path))
    except Exception as exc:  # DCP raises CheckpointException with per-rank causes
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"cannot load checkpoint {path}: {first}") from exc
    state = json.loads((path / TRAINER_STATE).read_text())
    rng = path / f"rng-rank-{dist.get_rank()}.pt"
    if rng.exists() and state.get("world_size") == dist.get_world_size():
        _set_rng_state(torch.load(rng, weights_only=False))
    return state


def _rng_state() -> dict[str, Any]:
    out = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state()
    return out


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
