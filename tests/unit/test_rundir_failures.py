"""The run directory's failure records (meshforge.rundir.failures): written by a rank,
read back, and the choice of the failure that caused the others."""

from __future__ import annotations

import json

from meshforge.rundir.failures import (
    choose_first_failure,
    clear_recorded_failures,
    describe_exit,
    failure_path,
    is_peer_failure,
    record_failure,
    recorded_failures,
    root_cause,
)


def test_a_rank_records_its_first_error_once(tmp_path):
    record_failure(tmp_path, 1, ValueError("bad batch\nsecond line"))
    record_failure(tmp_path, 1, RuntimeError("a later consequence"))
    (record,) = recorded_failures(tmp_path / "health")
    assert record["rank"] == 1 and record["error"] == "ValueError: bad batch"
    assert failure_path(tmp_path / "health", 1).exists()


def test_a_torn_record_is_skipped_and_clearing_removes_only_records(tmp_path):
    health = tmp_path / "health"
    record_failure(tmp_path, 0, OSError("disk"))
    (health / "failure-rank-3.json").write_text('{"rank": 3, "ti')
    (health / "diagnosis.json").write_text("{}")
    assert [r["rank"] for r in recorded_failures(health)] == [0]
    clear_recorded_failures(health)
    assert sorted(p.name for p in health.iterdir()) == ["diagnosis.json"]


def test_the_cause_is_a_ranks_own_error_not_a_peers_broken_connection():
    recorded = [
        {"rank": 0, "time": 1.0, "error": "RuntimeError: Connection reset by peer"},
        {"rank": 2, "time": 2.0, "error": "ValueError: loss is nan"},
    ]
    assert is_peer_failure(recorded[0]["error"]) and not is_peer_failure(recorded[1]["error"])
    assert root_cause(recorded, [])["rank"] == 2
    failures = [{"rank": 0, "exitcode": 1, "exit": "exit code 1"}]
    first = choose_first_failure(recorded, failures, agent_first=0)
    assert first["rank"] == 2 and first["error"] == "ValueError: loss is nan"


def test_a_rank_killed_by_an_outside_signal_is_the_cause():
    recorded = [{"rank": 0, "time": 1.0, "error": "RuntimeError: timed out"}]
    failures = [
        {"rank": 0, "exitcode": 1, "exit": "exit code 1"},
        {"rank": 1, "exitcode": -9, "exit": describe_exit(-9)},
    ]
    assert failures[1]["exit"] == "killed by SIGKILL"
    assert root_cause(recorded, failures) is None
    assert choose_first_failure(recorded, failures, agent_first=0)["rank"] == 1


def test_records_are_plain_json(tmp_path):
    record_failure(tmp_path, 4, KeyError("x"))
    data = json.loads(failure_path(tmp_path / "health", 4).read_text())
    assert set(data) == {"rank", "time", "error"}


def test_a_restarts_cause_is_an_own_error_else_the_rank_that_said_nothing():
    from meshforge.rundir.restarts import restart_cause

    peer = {"rank": 0, "time": 1.0, "error": "RuntimeError: Connection closed by peer"}
    own = {"rank": 1, "time": 2.0, "error": "ValueError: bad shard"}
    assert restart_cause([peer, own], world_size=2) is own
    silent = restart_cause([peer], world_size=3)  # ranks 1 and 2 recorded nothing
    assert silent["rank"] == 1 and "without an error" in silent["error"]
    both = [peer, {**peer, "rank": 1, "time": 0.5}]
    assert restart_cause(both, world_size=2)["rank"] == 1  # all peers': the earliest


def test_restart_gaps_pair_each_restart_with_its_resumption(tmp_path):
    from meshforge.rundir.restarts import append_restart, restarts_of_run

    append_restart(tmp_path, {"run_id": "a", "attempt": 1, "failed_at": 10.0})
    append_restart(tmp_path, {"run_id": "b", "attempt": 1, "failed_at": 11.0})
    append_restart(tmp_path, {"run_id": "a", "attempt": 1, "kind": "resumed", "resumed_at": 12.5})
    (restart,) = restarts_of_run(tmp_path, "a")
    assert restart["gap_s"] == 2.5 and restart["resumed_at"] == 12.5
    assert restarts_of_run(tmp_path, None) == []
    assert restarts_of_run(tmp_path, "b")[0]["gap_s"] is None  # not resumed (yet)
