"""The flight records (health/flight-rank-K.json, observe/flight.py) of the newest
launch. A run resumed on fewer ranks leaves the records of the ranks it no longer has
(rank 1 of an ep2 run resumed at world 1): they are not this launch's ranks, and a
reader that listed them would show a stale rank that is not running."""

from __future__ import annotations

from typing import Any


def newest_world(records: dict[int, Any]) -> dict[int, Any]:
    """`records` (rank -> its record, or None where unreadable) without the ranks
    outside the newest record's world (the most recently started one's world_size)."""
    dated = [
        r for r in records.values() if isinstance(r, dict) and isinstance(r.get("world_size"), int)
    ]
    if not dated:
        return records
    newest = max(dated, key=lambda r: r.get("started") or 0)
    return {k: v for k, v in records.items() if k < newest["world_size"]}
