"""A checkpoint's files as the run directory holds them: step folders, the manifest
that commits one (every file with its size and sha256), the check that it is whole,
the listing, the newest valid one and pruning. Torch-free: writing and reading the
tensors (DCP) is train/checkpoint.py's."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from meshforge.fileio import atomic_writer
from meshforge.rundir.paths import confined

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
TRAINER_STATE = "trainer_state.json"


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def file_entry(path: Path) -> dict[str, Any]:
    return {"sha256": sha256_of(path), "bytes": path.stat().st_size}


def hash_own_files(directory: Path, rank: int) -> dict[str, dict[str, Any]]:
    """Entries for the files this rank wrote: its DCP shards and its RNG state."""
    own = [*directory.glob(f"__{rank}_*"), directory / f"rng-rank-{rank}.pt"]
    return {p.name: file_entry(p) for p in own if p.is_file()}


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
        entries[rel] = hashed.get(rel) or file_entry(p)
    manifest = {"format": "meshforge-checkpoint-v1", "step": step, "files": entries}
    # a new temporary name, never through a link planted there (fileio.atomic_writer)
    with atomic_writer(directory / MANIFEST, "w", fsync=True, encoding="utf-8") as f:
        json.dump(manifest, f, indent=1)
    return manifest


def verify(directory: Path) -> str | None:
    """None when the checkpoint is complete and intact, else the reason it is not."""
    mpath = directory / MANIFEST
    if not mpath.exists():
        return "no manifest"
    try:
        manifest = json.loads(mpath.read_text())
        files = manifest["files"]
        items = list(files.items())
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError):
        return "manifest is not valid JSON"
    for rel, meta in items:
        p = confined(directory, rel, _manifest_of(directory))  # DataError when it leaves
        if not p.exists():
            return f"missing file {rel}"
        try:
            intact = p.stat().st_size == meta["bytes"] and sha256_of(p) == meta["sha256"]
        except (KeyError, TypeError):
            return f"manifest entry of {rel} is not valid"
        if not intact:
            return f"checksum mismatch in {rel}"
    return None


def _manifest_of(directory: Path) -> str:
    return f"{MANIFEST} of {directory.parent.name}/{directory.name}"


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


def find_latest_valid(
    ckpt_root: Path, warn: Callable[[str], object] = log.warning
) -> tuple[int, Path] | None:
    for step, path in reversed(list_checkpoints(ckpt_root)):
        problem = verify(path)
        if problem is None:
            return step, path
        warn(f"skipping checkpoint {path.name}: {problem}")
    return None


def prune(ckpt_root: Path, keep: int) -> None:
    for _, path in list_checkpoints(ckpt_root)[:-keep]:
        shutil.rmtree(path, ignore_errors=True)


def is_committed(directory: Path) -> bool:
    """Its manifest is there and every file it names is there with its size (a cheap
    check, without hashing: `verify` is the full one). A manifest naming a path out of
    DIRECTORY is a DataError (rundir/paths.py), not an uncommitted checkpoint."""
    try:
        files = json.loads((directory / MANIFEST).read_text()).get("files")
    except (OSError, ValueError, AttributeError):
        return False
    if not isinstance(files, dict):
        return False
    paths = {rel: confined(directory, rel, _manifest_of(directory)) for rel in files}
    try:
        return all(paths[rel].stat().st_size == meta["bytes"] for rel, meta in files.items())
    except (OSError, KeyError, TypeError):
        return False


def committed_checkpoints(run_dir: Path) -> list[int]:
    """The steps of RUN_DIR's committed checkpoints, oldest first."""
    return [step for step, path in list_checkpoints(Path(run_dir) / "checkpoints")
            if is_committed(path)]  # fmt: skip
