"""A run resumed on fewer ranks leaves the flight records of the ranks it no longer
has: `top`, `diagnose` and the metrics exporter read only the newest launch's ranks."""

from __future__ import annotations

import json
from pathlib import Path

from meshforge.health.evidence import collect
from meshforge.observe.flight import read_flight_records
from meshforge.report.top import _flight_records
from meshforge.rundir.flights import newest_world


def _record(rank: int, world: int, started: float) -> dict:
    return {"rank": rank, "world_size": world, "started": started, "time": started + 60,
            "status": "finished", "step": 30}  # fmt: skip


def _run(tmp_path: Path) -> Path:
    """ep2 at world 2 (started at t=100), then resumed at world 1 (t=500)."""
    health = tmp_path / "health"
    health.mkdir(parents=True)
    for record in (_record(0, 1, 500.0), _record(1, 2, 100.0)):
        (health / f"flight-rank-{record['rank']}.json").write_text(json.dumps(record))
    (tmp_path / "config.yaml").write_text("name: x\n")
    return tmp_path


def test_newest_world_keeps_the_latest_launchs_ranks() -> None:
    old = {0: _record(0, 2, 100.0), 1: _record(1, 2, 100.0)}
    assert newest_world(old) == old  # one launch: all its ranks
    resumed = {0: _record(0, 1, 500.0), 1: _record(1, 2, 100.0), 2: None}
    assert list(newest_world(resumed)) == [0]
    assert newest_world({3: None}) == {3: None}  # nothing to date: left as read


def test_top_diagnose_and_the_exporter_leave_out_the_earlier_launchs_rank(tmp_path) -> None:
    run = _run(tmp_path)
    assert list(_flight_records(run / "health")) == [0]
    assert [r["rank"] for r in read_flight_records(run / "health")] == [0]
    ranks = collect(run).ranks
    assert list(ranks) == [0]
