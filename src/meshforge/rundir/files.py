"""The files meshforge writes into a run directory, the run one holds as read back from
them, and `--fresh`'s removal of them.

A run directory keeps one run's whole history; what a launch does with the run there is
launch/rundir.py's decision (it needs the job config). Here, torch-free: the names
(RUN_FILES, RUN_FOLDERS, the lock files, the markers of a run), the earlier run as its
files say (`earlier_run`: its config.yaml, report.json, committed checkpoints and
segments; never report.json alone, which may be missing or stale), and
`remove_earlier_run`, which removes what meshforge wrote and keeps the rest.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from meshforge.errors import ConfigError
from meshforge.rundir.checkpoints import TRAINER_STATE, committed_checkpoints, step_dir_name
from meshforge.rundir.report import REPORT_FILE, REPORT_TMP, read_report_or_none
from meshforge.rundir.segments import SEGMENTS_FILE, read_records

# A job's hold on its run directory (runtime/runlock.py): `--fresh` never removes these.
LOCK_FILE = ".lock"
WORKERS_LOCK_FILE = ".lock-workers"  # held by the workers of a launcher that holds .lock
LOCK_FILES = (LOCK_FILE, WORKERS_LOCK_FILE)

# What meshforge writes into a run directory, and `--fresh` removes: these entries
# (glob patterns) at its top, and in each of its folders the entries named here; a
# folder left empty goes too. Anything else (a file of yours in logs/, say) stays.
RUN_FILES = (
    "config.yaml",
    "metrics.jsonl",
    SEGMENTS_FILE,
    REPORT_FILE,
    REPORT_TMP,
    "report.png",
    "report.html",
    "trace.json",
    "compare-*.html",
    ".*.tmp",  # atomic writes caught halfway (fileio.write_text_atomic, plots)
)
RUN_FOLDERS = {
    "checkpoints": ("step-*", ".tmp-step-*"),
    "logs": ("rank-*.log", "elastic"),
    "health": (
        "diagnosis.json",
        "flight-rank-*.json",
        "failure-rank-*.json",
        "restarts.jsonl",
        "preflight.json",
        ".*.tmp",
    ),
    "system": ("*.jsonl", ".*.tmp"),
    "tensorboard": ("events.out.tfevents.*",),
    "wandb": ("meshforge-run-id", "run-*", "offline-run-*", "latest-run", "debug*.log"),
    "export": ("step-*-*", ".step-*"),
    ".launch": ("job-*.yaml",),
    ".trace": ("rank-*.json",),
}
# Any of these says a run was there (a lock alone, or files of yours, do not).
RUN_MARKERS = ("config.yaml", "metrics.jsonl", REPORT_FILE, "checkpoints", SEGMENTS_FILE)


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


def is_job_config(config: dict[str, Any]) -> bool:
    """Whether a config.yaml is a meshforge job's (as `save_config` writes it)."""
    return all(isinstance(config.get(key), dict) for key in ("model", "data", "train"))


def remove_earlier_run(run_dir: Path) -> str | None:
    """`--fresh`: remove what meshforge wrote into RUN_DIR (RUN_FILES, RUN_FOLDERS),
    keeping its lock files (the caller holds them) and anything meshforge does not
    write. The line to print, naming what was kept, or None when nothing was removed."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return None
    earlier = earlier_run(run_dir)
    reached = max(earlier.checkpoints, default=None) if earlier else None
    found: list[Path] = []
    for pattern in RUN_FILES:
        found += [p for p in sorted(run_dir.glob(pattern)) if p not in found]
    folders = [run_dir / name for name in RUN_FOLDERS if (run_dir / name).is_dir()]
    for folder in folders:
        for pattern in RUN_FOLDERS[folder.name]:
            found += [p for p in sorted(folder.glob(pattern)) if p not in found]
    for path in found:
        _remove(path)
    for folder in folders:  # emptied, it goes too (a link to a folder elsewhere stays)
        if not folder.is_symlink() and not any(folder.iterdir()):
            _remove(folder)
    if not found:
        return None
    kept = _kept(run_dir)
    what = f"checkpoints up to step {reached}, " if reached is not None else ""
    line = f"meshforge: --fresh: removed the earlier run in {run_dir} ({what}{len(found)} entries)"
    if kept:
        shown = ", ".join(kept[:5]) + (f" and {len(kept) - 5} more" if len(kept) > 5 else "")
        noun = "entry" if len(kept) == 1 else "entries"
        line += f"; kept {len(kept)} {noun} meshforge did not write ({shown})"
    return line + "; starting over"


def _remove(path: Path) -> None:
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    except OSError as exc:
        raise ConfigError(f"--fresh: cannot remove {path}: {exc.strerror or exc}") from None


def _kept(run_dir: Path) -> list[str]:
    """What is left in RUN_DIR that meshforge did not write (lock files aside)."""
    kept = []
    for p in sorted(run_dir.iterdir()):
        if p.name in LOCK_FILES:
            continue
        if p.name in RUN_FOLDERS and p.is_dir():
            kept += [f"{p.name}/{q.name}" for q in sorted(p.iterdir())]
        else:
            kept.append(p.name)
    return kept
