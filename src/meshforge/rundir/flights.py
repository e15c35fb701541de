"""The flight records (health/flight-rank-K.json, observe/flight.py) of the newest
launch's ranks. A run resumed on fewer ranks leaves the records of the ranks it no
longer has (rank 1 of an ep2 run resumed at world 1): they are not ranks of the run as
it is now, and a reader that listed them would show a stale rank that is not running.
The world size is the newest segment's (segments.jsonl, written by global rank 0)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from meshforge.rundir.segments import read_records


def newest_world(records: dict[int, Any], run_dir: Path) -> dict[int, Any]:
    """`records` (rank -> its record, or None where unreadable) without the ranks
    outside the newest segment's world (all of them when no segment is recorded)."""
    starts = [r for r in read_records(run_dir) if r.get("event") == "start"]
    world = starts[-1].get("world_size") if starts else None
    if not isinstance(world, int) or world < 1:
        return records
    return {k: v for k, v in records.items() if k < world}
