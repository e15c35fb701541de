"""What meshforge wrote into a run directory: the names it writes there, and the record
of the top-level entries it created (RUN_DIR/.meshforge-outputs.jsonl), so that
`--fresh` removes what meshforge wrote and nothing else.

Every writer of a top-level entry goes through `claim` (or `claim_dir`) before it
creates it: an entry that is not there yet is recorded first, then created, so whatever
is later found under a recorded name was made by meshforge; an entry that was there
before (a file or folder of yours, a symlink) is not recorded and never becomes
meshforge's. A launch claims the names its run will write (`claim_all`, from
launch/train.py) once it holds the run directory's lock and before anything is
written: the writers of a run (workers, sinks, the report) write only while it holds
the directory. Commands that write into a run directory outside a launch claim their
own entry (`meshforge export`: export/, `meshforge report`: report.html, ...).

Records, one JSON object a line: {"entry": "metrics.jsonl"} or, for an entry an older
meshforge wrote before this record existed, {"entry": "logs", "adopted": true}.

A run directory without the record is an older meshforge's (or was made by hand). The
first claim there adopts its entries that bear the names meshforge writes (RUN_FILES,
RUN_FOLDERS; files only when the directory holds a run) and are real files or folders
(a symlink never is meshforge's): an older `--fresh` removed those, and so does
`--fresh` there now (`legacy_entries`, in a folder only the entries RUN_FOLDERS names).

Torch-free, plain files (DESIGN.md layer 1)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

from meshforge.errors import ConfigError
from meshforge.rundir.records import read_jsonl
from meshforge.rundir.report import REPORT_FILE, REPORT_TMP
from meshforge.rundir.segments import SEGMENTS_FILE

OUTPUTS_FILE = ".meshforge-outputs.jsonl"

# A job's hold on its run directory (runtime/runlock.py): `--fresh` never removes these.
LOCK_FILE = ".lock"
WORKERS_LOCK_FILE = ".lock-workers"  # held by the workers of a launcher that holds .lock
LOCK_FILES = (LOCK_FILE, WORKERS_LOCK_FILE)

# What meshforge writes into a run directory: these entries (glob patterns) at its top,
# and in each of its folders the entries named here (a folder it created that is not
# named here: everything in it). Anything else (a file of yours in logs/, say) is not.
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
    "checkpoints": ("step-[0-9]*", ".tmp-step-[0-9]*"),  # step-NNNNNNNN, not step-mine
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


def recorded_outputs(run_dir: Path) -> set[str] | None:
    """The top-level entries meshforge recorded creating in RUN_DIR; None when it keeps
    no record (an older meshforge's run directory, or none at all)."""
    path = Path(run_dir) / OUTPUTS_FILE
    if path.is_symlink() or not path.is_file():
        return None  # a record is a file meshforge made, never a link to one
    try:
        records = read_jsonl(path)
    except (OSError, ValueError):
        records = []  # damaged: nothing in it is trusted to be meshforge's
    return {r["entry"] for r in records if _is_entry_name(r.get("entry"))}


def claim(run_dir: Path, name: str) -> bool:
    """Before creating the top-level entry NAME of RUN_DIR: record it as meshforge's when
    it is not there yet. True when NAME is meshforge's (recorded now or before); False
    when something meshforge did not create is there already (leave it be, or write
    into it knowing that `--fresh` will keep it). A symbolic link at NAME is refused
    (ConfigError): meshforge writes a run's outputs into the run directory itself, never
    through a link planted there (a received run directory is data)."""
    if not _is_entry_name(name):
        raise ValueError(f"not a top-level entry name: {name!r}")
    run_dir = Path(run_dir)
    if (run_dir / name).is_symlink():
        raise ConfigError(
            f"{run_dir / name} is a symbolic link: meshforge writes a run's files into the "
            "run directory itself, never through a link; remove the link or choose "
            "another --run-dir"
        )
    try:
        ours = recorded_outputs(run_dir)
        if ours is None:
            ours = _start(run_dir)
        if name in ours:
            return True
        if os.path.lexists(run_dir / name):
            return False
        _append(run_dir, [{"entry": name}])
    except OSError as exc:  # a read-only directory, a record that is a symlink, ...
        raise ConfigError(
            f"cannot record what meshforge writes in {run_dir / OUTPUTS_FILE}: "
            f"{exc.strerror or exc}"
        ) from None
    return True


def claim_dir(run_dir: Path, name: str) -> Path:
    """RUN_DIR/NAME as a folder, claimed (see `claim`) and then made if absent."""
    claim(run_dir, name)
    path = Path(run_dir) / name
    path.mkdir(exist_ok=True)
    return path


def claim_all(run_dir: Path, names: Iterable[str]) -> None:
    """A launch's claim of the entries its run will write (see the module docstring)."""
    for name in dict.fromkeys(names):
        claim(run_dir, name)


def rewrite_outputs(run_dir: Path, names: Iterable[str]) -> None:
    """Replace the record with NAMES (after `--fresh` removed the others)."""
    path = Path(run_dir) / OUTPUTS_FILE
    tmp = path.with_name(f".{OUTPUTS_FILE}.tmp-{os.getpid()}")
    tmp.write_text("".join(json.dumps({"entry": n}) + "\n" for n in sorted(names)))
    os.replace(tmp, path)


def legacy_entries(run_dir: Path) -> list[str]:
    """The top-level entries of RUN_DIR that bear a name meshforge writes there and are
    real files or folders (a symlink never is meshforge's): what an older meshforge,
    which kept no record, wrote as far as its names say."""
    run_dir = Path(run_dir)
    found: list[str] = []
    for pattern in RUN_FILES:
        found += [p.name for p in sorted(run_dir.glob(pattern))
                  if p.is_file() and not p.is_symlink()]  # fmt: skip
    found += [name for name in RUN_FOLDERS
              if (run_dir / name).is_dir() and not (run_dir / name).is_symlink()]  # fmt: skip
    return [n for n in dict.fromkeys(found) if n not in LOCK_FILES and n != OUTPUTS_FILE]


def is_job_config(config: dict[str, Any]) -> bool:
    """Whether a config.yaml is a meshforge job's (as `save_config` writes it)."""
    return all(isinstance(config.get(key), dict) for key in ("model", "data", "train"))


def holds_a_run(run_dir: Path) -> bool:
    """Whether RUN_DIR holds what only a meshforge run leaves: a config.yaml that is a
    job config, checkpoints/ or segments.jsonl. A metrics.jsonl or report.json alone, or
    a config.yaml of another kind, may be the user's own (the launcher refuses such a
    folder, rundir.py `check_is_a_run`): they are never adopted as meshforge's."""
    run_dir = Path(run_dir)
    if any(os.path.lexists(run_dir / name) for name in ("checkpoints", SEGMENTS_FILE)):
        return True
    config = run_dir / "config.yaml"
    if config.is_symlink() or not config.is_file():
        return False
    try:
        loaded = yaml.safe_load(config.read_text())
    except (OSError, ValueError, yaml.YAMLError):
        return False
    return isinstance(loaded, dict) and is_job_config(loaded)


def _start(run_dir: Path) -> set[str]:
    """Begin the record; adopt an older meshforge's entries (the module docstring)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    adopted = legacy_entries(run_dir)
    if not holds_a_run(run_dir):  # its folders only (logs/ kept by --fresh for a file in it)
        adopted = [name for name in adopted if name in RUN_FOLDERS]
    _append(run_dir, [{"entry": name, "adopted": True} for name in adopted])
    return set(adopted)


def _append(run_dir: Path, records: list[dict[str, object]]) -> None:
    """Lines appended whole (one write of O_APPEND: concurrent claims do not mix)."""
    text = "".join(json.dumps(r) + "\n" for r in records).encode()
    fd = os.open(Path(run_dir) / OUTPUTS_FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT
                 | getattr(os, "O_NOFOLLOW", 0), 0o644)  # fmt: skip
    try:
        if text:
            os.write(fd, text)
    finally:
        os.close(fd)


def _is_entry_name(name: object) -> bool:
    return (
        isinstance(name, str)
        and name not in ("", ".", "..", OUTPUTS_FILE)
        and "/" not in name
        and "\\" not in name
        and "\0" not in name
    )
