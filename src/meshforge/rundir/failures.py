"""Failure records of a run directory: the error each rank records itself
(health/failure-rank-K.json, written by the worker), and the choice of the failure
that caused the others (the launcher's message, `diagnose`, the restart records).

Torch-free: launch/, health/, train/ and Fabric read and write them here."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

FAILURE_GLOB = "failure-rank-*.json"


def failure_path(health: Path, rank: int) -> Path:
    """Where rank RANK records its own error (HEALTH: the run's health/ folder)."""
    return health / f"failure-rank-{rank}.json"


def describe_exit(exitcode: int) -> str:
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


def record_failure(run_dir: Path, rank: int, exc: BaseException) -> None:
    health = run_dir / "health"
    path = failure_path(health, rank)
    if path.exists():
        return
    try:
        health.mkdir(parents=True, exist_ok=True)
        message = f"{type(exc).__name__}: {exc}".strip().splitlines()[0]
        path.write_text(json.dumps({"rank": rank, "time": time.time(), "error": message}))
    except OSError:
        pass


# Errors a rank raises because a peer died: consequences, not causes.
_PEER_FAILURE_MARKERS = (
    "closed by peer",
    "reset by peer",
    "connection reset",
    "broken pipe",
    "timed out",
    "timeout",
    "connectfullmesh",
)


def is_peer_failure(error: str) -> bool:
    text = error.lower()
    return any(marker in text for marker in _PEER_FAILURE_MARKERS)


def root_cause(recorded: list[dict], failures: list[dict]) -> dict | None:
    """Pick the failure that caused the others.

    In order: the earliest error a rank recorded itself that is not a peer's broken
    connection; else a rank killed by a signal the agent did not send (SIGKILL by the
    OOM killer, SIGSEGV, ...); else the earliest recorded error; else None."""
    causes = [r for r in recorded if not is_peer_failure(r["error"])]
    if causes:
        return min(causes, key=lambda r: r["time"])
    killed = [f for f in failures if f["exitcode"] < 0 and f["exit"] != "killed by SIGTERM"]
    if killed:
        return None  # the agent's own record of the signal is the cause
    return min(recorded, key=lambda r: r["time"]) if recorded else None


def choose_first_failure(recorded: list[dict], failures: list[dict], agent_first: int) -> dict:
    """The failure to name as the cause of the others, with its error: root_cause's
    pick; else a rank killed by a signal the agent did not send; else the rank the agent
    saw fail first (AGENT_FIRST). A rank whose record names it the cause but that the
    agent has not seen exit gets a new entry, not added to FAILURES."""
    cause = root_cause(recorded, failures)
    if cause is None:
        killed = [f for f in failures if f["exitcode"] < 0 and f["exit"] != "killed by SIGTERM"]
        return killed[0] if killed else next(f for f in failures if f["rank"] == agent_first)
    # The agent sees whichever process exited first; a rank that raised may still be
    # tearing down while its peers die of the broken connection.
    first = next((f for f in failures if f["rank"] == cause["rank"]), None)
    if first is None:
        first = {"rank": cause["rank"], "exit": "stopped by the agent after failing"}
    first["error"] = cause["error"]
    return first


def recorded_failures(health: Path) -> list[dict]:
    """The failures the workers recorded themselves (health/failure-rank-K.json)."""
    records = []
    for path in health.glob(FAILURE_GLOB):
        try:
            records.append(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError):
            continue
    return records


def clear_recorded_failures(health: Path) -> None:
    for path in health.glob(FAILURE_GLOB):
        path.unlink(missing_ok=True)
