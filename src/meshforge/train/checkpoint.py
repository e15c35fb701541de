"""Atomic, resharding checkpoints with torch.distributed.checkpoint (DCP).

A checkpoint is a directory `checkpoints/step-NNNNNNNN/` holding the DCP shards
of the model and optimizer (keyed by parameter name, so any layout can load any
other: DCP reshards), `trainer_state.json` (step, LR schedule, loss scaler),
`rng-rank-K.pt` and a `manifest.json` with the sha256 of every file.

Commit protocol: every rank writes into `.tmp-step-NNNNNNNN/`; after a barrier
rank 0 hashes the files, writes the manifest, and renames the directory into
place. A crash before the rename leaves only a temporary directory, which is
ignored; a directory whose checksums do not match is skipped with a warning.
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


def write_manifest(directory: Path, step: int) -> dict[str, Any]:
    files = sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST)
    manifest = {
        "format": "meshforge-checkpoint-v1",
        "step": step,
        "files": {
            str(p.relative_to(directory)): {"sha256": _sha256(p), "bytes": p.stat().st_size}
            for p in files
        },
    }
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

    model: dict[str, torch.Tensor]
    optimizer: dict[str, dict[str, torch.Tensor]]
    trainer_state: dict[str, Any]  # rank 0's is written


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
    dist.barrier()
    if rank == 0:
        if fail_before_commit(step):
            raise RuntimeError(f"injected fault before committing checkpoint of step {step}")
        write_manifest(tmp, step)
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
