"""RUN_DIR/report.json, the run's summary (schema in DESIGN.md): where it is, its atomic
write and its reading. What it holds is built by train/report.py; its readers are the
viewers (report/top.py, report/html.py), the launcher, `diagnose`, `cost --run`,
`bench --run`, `scale` and `plan`.

`read_report` is for a reader that says what is wrong with the file (DataError naming
it); `read_report_or_none` for one that must go on without it (a live view, a launcher
after its workers): absent, unreadable and malformed alike are None."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from meshforge.errors import DataError
from meshforge.fileio import write_text_atomic

REPORT_FILE = "report.json"
REPORT_TMP = REPORT_FILE + ".tmp"  # older versions' atomic write, caught halfway by a crash


class ReportError(DataError):
    """report.json is there but is no report. `problem` says why: "unreadable" (an
    OSError), "not JSON" (cut short, not UTF-8, not JSON) or "not an object"."""

    def __init__(self, message: str, problem: str) -> None:
        super().__init__(message)
        self.problem = problem


def report_path(run_dir: str | os.PathLike[str]) -> Path:
    return Path(run_dir) / REPORT_FILE


def write_report(run_dir: str | os.PathLike[str], report: dict[str, Any]) -> None:
    """Replace report.json at once: a reader sees the old report or the new one."""
    write_text_atomic(report_path(run_dir), json.dumps(report, indent=2))


def read_report(run_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """RUN_DIR's report, None when it has none; ReportError (a DataError naming the
    file) when it cannot be read, is not JSON or not a JSON object."""
    path = report_path(run_dir)
    try:
        report = json.loads(path.read_text())
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        raise ReportError(f"{path}: not readable JSON ({exc})", "unreadable") from None
    except ValueError as exc:  # json.JSONDecodeError, UnicodeDecodeError
        raise ReportError(f"{path}: not readable JSON ({exc})", "not JSON") from None
    if not isinstance(report, dict):
        raise ReportError(f"{path}: expected a JSON object", "not an object")
    return report


def read_report_or_none(run_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """RUN_DIR's report, or None when it is absent, unreadable or no JSON object."""
    try:
        return read_report(run_dir)
    except DataError:
        return None
