"""A run resumed on fewer ranks leaves the flight records of the ranks it no longer
has: `top`, `diagnose` and the metrics exporter read only the newest segment's ranks."""

from __future__ import annotations

import json
from pathlib import Path

from meshforge.health.evidence import collect
from meshforge.observe.flight import read_flight_records
from meshforge.report.top import _flight_records
from meshforge.rundir.flights import newest_world
from meshforge.rundir.segments import open_segment


def _record(rank: int, world: int, started: float) -> dict:
    return {"rank": rank, "world_size": world, "started": started, "time": started + 60,
            "status": "finished", "step": 30}  # fmt: skip


def _run(tmp_path: Path) -> Path:
    """ep2 at world 2, then resumed at world 1: rank 1's record is the first launch's."""
    health = tmp_path / "health"
    health.mkdir(parents=True)
    for record in (_record(0, 1, 500.0), _record(1, 2, 100.0)):
        (health / f"flight-rank-{record['rank']}.json").write_text(json.dumps(record))
    (tmp_path / "config.yaml").write_text("name: x\n")
    open_segment(tmp_path, start_step=0, steps=30, lr_horizon=30, world_size=2, layout={})
    open_segment(tmp_path, start_step=30, steps=40, lr_horizon=30, world_size=1, layout={})
    return tmp_path


def test_newest_world_keeps_the_newest_segments_ranks(tmp_path) -> None:
    records = {0: _record(0, 2, 100.0), 1: _record(1, 2, 100.0), 2: None}
    assert newest_world(records, tmp_path) == records  # no segment recorded: all
    open_segment(tmp_path, start_step=0, steps=30, lr_horizon=30, world_size=2, layout={})
    assert list(newest_world(records, tmp_path)) == [0, 1]
    open_segment(tmp_path, start_step=30, steps=40, lr_horizon=30, world_size=1, layout={})
    assert list(newest_world(records, tmp_path)) == [0]


def test_top_diagnose_and_the_exporter_leave_out_the_earlier_launchs_rank(tmp_path) -> None:
    run = _run(tmp_path)
    assert list(_flight_records(run / "health")) == [0]
    assert [r["rank"] for r in read_flight_records(run / "health")] == [0]
    assert list(collect(run).ranks) == [0]
