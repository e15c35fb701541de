"""The files meshforge writes into a run directory, the run one holds as read back from
them, and `--fresh`'s removal of them.

A run directory keeps one run's whole history; what a launch does with the run there is
launch/rundir.py's decision (it needs the job config). Here, torch-free: the earlier run
as its files say (`earlier_run`: its config.yaml, report.json, committed checkpoints and
segments; never report.json alone, which may be missing or stale), and
`remove_earlier_run`, which removes what meshforge recorded writing (rundir/outputs.py
has the names and the record) and keeps the rest.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from meshforge.errors import ConfigError, DataError
from meshforge.rundir.checkpoints import (
    MANIFEST,
    TRAINER_STATE,
    committed_checkpoints,
    step_dir_name,
)
from meshforge.rundir.outputs import (
    LOCK_FILE,
    LOCK_FILES,
    OUTPUTS_FILE,
    RUN_FILES,
    RUN_FOLDERS,
    RUN_MARKERS,
    WORKERS_LOCK_FILE,
    is_job_config,
    legacy_entries,
    recorded_outputs,
    rewrite_outputs,
)
from meshforge.rundir.report import REPORT_FILE, read_report_or_none
from meshforge.rundir.segments import SEGMENTS_FILE, read_records

# the names meshforge writes and the record of what it created are rundir/outputs.py's
# (they stay importable from here)
__all__ = ["LOCK_FILE", "LOCK_FILES", "RUN_FILES", "RUN_FOLDERS", "RUN_MARKERS",
           "WORKERS_LOCK_FILE", "EarlierRun", "earlier_run", "is_job_config",
           "remove_earlier_run"]  # fmt: skip


@dataclass
class EarlierRun:
    """What a run directory says about the run it holds."""

    run_dir: Path
    config: dict[str, Any]  # config.yaml as written ({} when absent or unreadable)
    report: dict[str, Any]  # report.json ({} when absent or unreadable)
    checkpoints: list[int]  # steps of the committed checkpoints
    records: list[dict[str, Any]] = field(default_factory=list)  # segments.jsonl

    @property
    def reached(self) -> int | None:
        """The step of its newest committed checkpoint: where it goes on from."""
        return self.checkpoints[-1] if self.checkpoints else None

    @property
    def completed(self) -> bool:
        """Whether it finished at `reached` (rather than stopped or crashed there): a
        segment ended there completed, or its report says so."""
        step = self.reached
        if step is None:
            return False
        for r in self.records:
            if r.get("event") == "end" and r.get("ended") == "completed":
                if r.get("end_step") == step:
                    return True
        return self.report.get("status") == "completed" and self.report.get("steps") == step

    def lr_horizon(self, steps: int) -> int:
        """The horizon the workers' schedule will have: the newest checkpoint's (what
        they load), `steps` for a run that starts from step 0 or a checkpoint written
        before horizons were recorded (as train/trainer.py does)."""
        if self.reached is None:
            return steps
        state = _read(self.run_dir / "checkpoints" / step_dir_name(self.reached) / TRAINER_STATE,
                      json.loads)  # fmt: skip
        horizon = state.get("lr_horizon")
        return horizon if isinstance(horizon, int) and horizon > 0 else steps


def _read(path: Path, parse) -> dict[str, Any]:
    try:
        value = parse(path.read_text())
    except (OSError, ValueError, yaml.YAMLError):
        return {}
    return value if isinstance(value, dict) else {}


def earlier_run(run_dir: Path) -> EarlierRun | None:
    """The run RUN_DIR holds, or None when it holds none (absent, empty, or only a lock
    and files meshforge does not write)."""
    run_dir = Path(run_dir)
    if not any((run_dir / name).exists() for name in RUN_MARKERS):
        return None
    return EarlierRun(
        run_dir,
        _read(run_dir / "config.yaml", yaml.safe_load),
        read_report_or_none(run_dir) or {},
        committed_checkpoints(run_dir),
        read_records(run_dir),
    )


def remove_earlier_run(run_dir: Path) -> str | None:
    """`--fresh`: remove what meshforge wrote into RUN_DIR and keep everything else. The
    line to print, naming what was kept, or None when nothing was removed.

    What meshforge wrote: the top-level entries it recorded creating (rundir/outputs.py);
    in a folder among them that RUN_FOLDERS names, the entries named there (a file of
    yours in logs/ stays), the folder itself once empty. A run directory of an older
    meshforge, with no record, is taken as conservatively as its names allow: its real
    files and folders named as meshforge names them (`legacy_entries`), and the line
    says so. Never removed: the lock files (the caller holds them), anything not
    recorded, and any symlink, at the top or in a folder (unlinked only when it points
    within its own folder, as wandb's latest-run does): a symlink is never followed, so
    nothing outside the run directory is touched."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return None
    try:
        earlier = earlier_run(run_dir)
    except DataError:  # a manifest naming a path out of its checkpoint: removed all the same
        earlier = None
    reached = max(earlier.checkpoints, default=None) if earlier else None
    ours = recorded_outputs(run_dir)
    legacy = ours is None
    if legacy and earlier is not None and not _was_meshforges(earlier):
        if not _would_remove(run_dir, legacy_entries(run_dir)):
            return None
        raise ConfigError(
            f"--fresh: {run_dir} is not a meshforge run (no record of what meshforge wrote "
            "there, no job's config.yaml, committed checkpoint or segments.jsonl): nothing "
            "removed; choose another --run-dir"
        )
    entries = legacy_entries(run_dir) if legacy else sorted(ours)
    if "checkpoints" not in entries or (run_dir / "checkpoints").is_symlink():
        reached = None  # not meshforge's to remove: its checkpoints stay
    removed = 0
    remaining: list[str] = []
    for name in entries:
        path = run_dir / name
        if name in LOCK_FILES or not os.path.lexists(path):
            continue
        if path.is_symlink():  # never meshforge's, never followed
            continue
        if path.is_dir():
            removed += _empty_folder(path, RUN_FOLDERS.get(name, ("*", ".*")))
            if any(path.iterdir()):
                remaining.append(name)
                continue
        _remove(path)
        removed += 1
    if not legacy:  # what stays of meshforge's (logs/ with a file of yours) stays recorded
        rewrite_outputs(run_dir, remaining)
    if not removed:
        return None
    kept = _kept(run_dir, set(entries))
    what = f"checkpoints up to step {reached}, " if reached is not None else ""
    line = f"meshforge: --fresh: removed the earlier run in {run_dir} ({what}{removed} entries)"
    if kept:
        shown = ", ".join(kept[:8]) + (f" and {len(kept) - 8} more" if len(kept) > 8 else "")
        noun = "entry" if len(kept) == 1 else "entries"
        line += f"; kept {len(kept)} {noun} meshforge did not write ({shown})"
    if legacy:
        line += (
            f"; {run_dir} kept no record of what meshforge wrote (an older meshforge's): "
            "removed only its files and folders named as meshforge names them, no symlink"
        )
    return line + "; starting over"


def _was_meshforges(earlier: EarlierRun) -> bool:
    """Whether a run directory without a record of meshforge's outputs shows a run of
    an older meshforge: a job's config.yaml, its own files (segments.jsonl, report.json)
    or a checkpoint with a manifest. A config.yaml, metrics.jsonl or report.html alone
    are names other tools use too."""
    run_dir = earlier.run_dir
    return (
        is_job_config(earlier.config)
        or any(os.path.lexists(run_dir / name) for name in (SEGMENTS_FILE, REPORT_FILE))
        or any((run_dir / "checkpoints").glob(f"step-[0-9]*/{MANIFEST}"))
    )


def _would_remove(run_dir: Path, entries: list[str]) -> bool:
    """Whether `--fresh` would remove anything of ENTRIES (a file, or a folder's entry
    that meshforge names there)."""
    for name in entries:
        path = run_dir / name
        if name in LOCK_FILES or path.is_symlink() or not os.path.lexists(path):
            continue
        if not path.is_dir():
            return True
        if any(any(path.glob(p)) for p in RUN_FOLDERS.get(name, ("*", ".*"))):
            return True
    return False


def _empty_folder(folder: Path, patterns: tuple[str, ...]) -> int:
    """Remove FOLDER's entries matching PATTERNS, keeping symlinks out of it; how many."""
    found: list[Path] = []
    for pattern in patterns:
        found += [p for p in sorted(folder.glob(pattern)) if p not in found]
    removed = 0
    for path in found:
        if path.is_symlink() and not _points_within(path, folder):
            continue
        _remove(path)
        removed += 1
    return removed


def _points_within(link: Path, folder: Path) -> bool:
    try:
        target = (link.parent / os.readlink(link)).resolve()
        return target.is_relative_to(folder.resolve())
    except (OSError, RuntimeError):
        return False


def _remove(path: Path) -> None:
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)  # removes the links in it, never what they point to
        else:
            path.unlink()
    except OSError as exc:
        raise ConfigError(f"--fresh: cannot remove {path}: {exc.strerror or exc}") from None


def _kept(run_dir: Path, entries: set[str]) -> list[str]:
    """What is left in RUN_DIR that meshforge did not write (lock files and its record
    aside): top-level entries, and what stays in the folders it wrote (never looking
    through a symlink)."""
    kept = []
    for p in sorted(run_dir.iterdir()):
        if p.name in LOCK_FILES or p.name == OUTPUTS_FILE:
            continue
        if p.name in entries and p.is_dir() and not p.is_symlink():
            kept += [f"{p.name}/{q.name}" for q in sorted(p.iterdir())]
        elif p.is_symlink():
            kept.append(f"{p.name} (a symlink, not followed)")
        else:
            kept.append(p.name)
    return kept
