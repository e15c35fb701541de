"""A run's segments: the launches (and elastic restarts) that trained one run directory.

A run directory keeps its whole history. Each time training starts in it (the first
launch, a resume after a crash or a stop, an elastic restart, an extension to a larger
`train.steps`), global rank 0 opens a segment: it appends a `start` record to
RUN_DIR/segments.jsonl before the first step, and an `end` record when the segment ends
cleanly (completed, or stopped by a signal after writing a checkpoint). Each metrics row
carries the number of the segment that wrote it, so a step trained twice has one row
per segment and every reader takes the latest (observe/metrics.py `latest_rows`).

A segment without an `end` record did not end cleanly: it `crashed` (an error, or a
kill that left no time to write), or it was `restarted` when the next segment is the
elastic agent's restart of the same launch (same run id, next attempt). Its end step is
the last step it logged. A launcher stopped by Ctrl-C closes its workers' open segment
as `stopped` when they could not (launch/local.py).

Records, one JSON object a line:

    {"event": "start", "segment": 2, "time": ..., "start_step": 10, "steps": 20,
     "lr_horizon": 20, "world_size": 1, "layout": {...}, "run_id": ..., "attempt": 0}
    {"event": "end", "segment": 2, "time": ..., "end_step": 20, "ended": "completed",
     "wall_s": 4.2}

Plain Python (no torch): the launcher reads it before any worker starts.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from meshforge.rundir.records import read_jsonl
from meshforge.rundir.restarts import read_restarts

SEGMENTS_FILE = "segments.jsonl"


def read_records(run_dir: Path) -> list[dict[str, Any]]:
    """The records of RUN_DIR/segments.jsonl ([] when there is none or it is unreadable:
    the segments are a summary, never a reason for a run to fail)."""
    path = Path(run_dir) / SEGMENTS_FILE
    try:
        return read_jsonl(path)
    except (OSError, ValueError):
        return []


def _append(run_dir: Path, record: dict[str, Any]) -> None:
    """One flushed and synced line: a crash right after leaves it whole or absent."""
    path = Path(run_dir) / SEGMENTS_FILE
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


def open_segment(
    run_dir: Path,
    *,
    start_step: int,
    steps: int,
    lr_horizon: int,
    world_size: int,
    layout: dict[str, Any],
    run_id: str | None = None,
    attempt: int = 0,
) -> int:
    """Record that a segment starts training at `start_step`; returns its number (1, 2,
    ...). Global rank 0 only, while the run directory is held."""
    numbers = [r.get("segment") for r in read_records(run_dir) if r.get("event") == "start"]
    segment = max((n for n in numbers if isinstance(n, int)), default=0) + 1
    _append(run_dir, {
        "event": "start",
        "segment": segment,
        "time": time.time(),
        "start_step": start_step,
        "steps": steps,
        "lr_horizon": lr_horizon,
        "world_size": world_size,
        "layout": layout,
        "run_id": run_id,
        "attempt": attempt,
    })  # fmt: skip
    return segment


def close_segment(run_dir: Path, segment: int, end_step: int, ended: str, **extra: Any) -> None:
    """Record how a segment ended: `completed` or `stopped` (with the signal)."""
    record = {"event": "end", "segment": segment, "time": time.time(), "end_step": end_step}
    _append(run_dir, {**record, "ended": ended, **extra})


def mark_first_step(run_dir: Path, segment: int, at: float) -> None:
    """Record when a segment's first step began (the launch's start-up ends at its
    first attempt's: report.json timing)."""
    _append(run_dir, {"event": "first_step", "segment": segment, "time": at})


def launch_first_step(run_dir: Path, run_id: str | None) -> float | None:
    """The first step of the launch `run_id` (the elastic agent's run id, shared by its
    restarts' segments): its first attempt's, when that one recorded it."""
    if run_id is None:
        return None
    records = read_records(run_dir)
    ours = {r.get("segment") for r in records if r.get("event") == "start"
            and r.get("run_id") == run_id}  # fmt: skip
    times = [r["time"] for r in records if r.get("event") == "first_step"
             and r.get("segment") in ours and isinstance(r.get("time"), int | float)]  # fmt: skip
    return min(times, default=None)


def _reached_before_restart(run_dir: Path, start: dict[str, Any]) -> int | None:
    """The step a restarted segment had reached, as its restart recorded it
    (health/restarts.jsonl `reached_before`): it may have logged no row since."""
    attempt = (start.get("attempt") or 0) + 1
    for entry in read_restarts(run_dir):
        if entry.get("run_id") == start.get("run_id") and entry.get("attempt") == attempt:
            reached = entry.get("reached_before")
            if isinstance(reached, int):
                return reached
    return None


def open_segment_number(run_dir: Path) -> int | None:
    """The newest segment if it has no end record yet (its workers are gone or running)."""
    records = read_records(run_dir)
    starts = [r["segment"] for r in records if r.get("event") == "start" and "segment" in r]
    if not starts:
        return None
    ended = {r.get("segment") for r in records if r.get("event") == "end"}
    return None if starts[-1] in ended else starts[-1]


def segments_of(run_dir: Path, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every segment of the run, in order: number, start and end step, world size,
    layout, why it ended, and its wall time. `rows` are the metrics rows as written (all
    of them, not only the latest of each step): an open segment ends at its last one."""
    records = read_records(run_dir)
    ends: dict[Any, dict[str, Any]] = {}
    for r in records:
        if r.get("event") == "end":
            ends.setdefault(r.get("segment"), r)  # the first word on a segment stands
    logged: dict[Any, dict[str, Any]] = {}  # segment -> its last logged row
    for row in rows:
        if isinstance(row.get("step"), int | float):
            last = logged.get(row.get("segment"))
            if last is None or row["step"] >= last["step"]:
                logged[row.get("segment")] = row
    starts = [r for r in records if r.get("event") == "start"]
    out = []
    for i, start in enumerate(starts):
        number = start.get("segment")
        end = ends.get(number)
        last = logged.get(number)
        begun = start.get("start_step", 0)
        item: dict[str, Any] = {
            "segment": number,
            "start_step": begun,
            "end_step": begun,
            "world_size": start.get("world_size"),
            "layout": start.get("layout"),
            "lr_horizon": start.get("lr_horizon"),
        }
        if end is not None:
            item.update(end_step=end.get("end_step", begun), ended=end.get("ended"))
            item["wall_s"] = end.get("wall_s")
            if end.get("signal"):
                item["signal"] = end["signal"]
        else:
            following = starts[i + 1] if i + 1 < len(starts) else None
            restarted = _restart_of(start, following)
            item["ended"] = "restarted" if restarted else "crashed"
            if last is not None:
                item["end_step"] = max(begun, int(last["step"]))
            reached = _reached_before_restart(run_dir, start) if restarted else None
            if reached is not None:
                item["end_step"] = max(item["end_step"], reached)
            times = [start.get("time"), (last or {}).get("time")]
            if all(isinstance(t, int | float) for t in times):
                item["wall_s"] = max(0.0, times[1] - times[0])
            else:
                item["wall_s"] = None
        out.append(item)
    return out


def _restart_of(segment: dict[str, Any], following: dict[str, Any] | None) -> bool:
    """Whether `following` is the elastic agent's restart of `segment` (same launch)."""
    if following is None or segment.get("run_id") is None:
        return False
    same_launch = following.get("run_id") == segment.get("run_id")
    return same_launch and following.get("attempt") == (segment.get("attempt") or 0) + 1
