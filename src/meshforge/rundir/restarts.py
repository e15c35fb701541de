"""A run's elastic restarts (health/restarts.jsonl): each restart's cause, where it
resumed and what it redid, then when training resumed; read back for the report's gaps.

The trainer's rank 0 appends them (train/trainer.py); the report, the segments and
`diagnose` read them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from meshforge.rundir.failures import is_peer_failure
from meshforge.rundir.records import read_jsonl


def restarts_path(run_dir: Path) -> Path:
    return Path(run_dir) / "health" / "restarts.jsonl"


def restart_cause(failures: list[dict[str, Any]], world_size: int) -> dict[str, Any]:
    """The failure that ended the previous attempt, from the ranks' own records of it
    (FAILURES, not empty unless a rank was killed silently): a rank's own error, not a
    broken connection to a peer; else the lowest rank that recorded nothing (its peers
    saw the connection break); else the earliest record."""
    own = [r for r in failures if not is_peer_failure(r["error"])]
    silent = sorted(set(range(world_size)) - {r["rank"] for r in failures})
    if own:
        return min(own, key=lambda r: r["time"])
    if silent:
        return {"rank": silent[0], "error": "ended without an error (killed by a signal?)"}
    return min(failures, key=lambda r: r["time"])


def append_restart(run_dir: Path, entry: dict[str, Any]) -> None:
    """One line of health/restarts.jsonl (a restart, or `kind: resumed`)."""
    path = restarts_path(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(entry) + "\n")


def read_restarts(run_dir: Path) -> list[dict[str, Any]]:
    path = restarts_path(run_dir)
    return read_jsonl(path) if path.exists() else []


def restarts_of_run(run_dir: Path, run_id: str | None) -> list[dict[str, Any]]:
    """The elastic restarts of launch RUN_ID, each with when training resumed and the
    gap from the previous attempt's failure to that."""
    mine = [r for r in read_restarts(run_dir) if run_id is not None and r.get("run_id") == run_id]
    resumed = {r["attempt"]: r["resumed_at"] for r in mine if r.get("kind") == "resumed"}
    restarts = [r for r in mine if r.get("kind") != "resumed"]
    for r in restarts:  # the gap: the previous attempt's failure to this one's first step
        r["resumed_at"] = resumed.get(r.get("attempt"))
        failed = r.get("failed_at")
        r["gap_s"] = r["resumed_at"] - failed if r["resumed_at"] and failed else None
    return restarts
