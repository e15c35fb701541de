"""`meshforge diagnose`: verdicts from run directories written by hand, shaped like the
ones real faults leave (tests/integration/test_faults.py makes the real ones)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml

from helpers import assert_one_line_error, meshforge
from meshforge.health.diagnose import diagnose_run, write_diagnosis
from meshforge.health.evidence import NotARunDirectory, error_kind

T0 = 1_700_000_000.0  # the runs below start here
RESET = (
    "RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] "
    "Read error [127.0.0.1]:15566: Connection reset by peer. This is typically caused by a "
    "remote worker hanging or bugs in the application."
)
TIMEOUT = (
    "RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/"
    "unbound_buffer.cc:78] Timed out waiting 10000ms for recv operation to complete"
)
OOM = "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
CONFIG = {
    "name": "t",
    "train": {"steps": 8, "micro_batch": 4},
    "runtime": {"timeout_s": 20, "step_timeout_s": 10},
    "observe": {"flight_every_s": 0.5},
}


def flight(rank: int, **fields) -> dict:
    """A flight record as observe/flight.py writes it; `fields` override."""
    record = {
        "rank": rank, "world_size": 2, "host": "vm", "pid": 100 + rank, "attempt": 0,
        "status": "running", "time": T0 + 5, "started": T0, "phase": "backward",
        "phase_since": T0 + 4.9, "step": 3, "last_progress": T0 + 4.8, "call": None,
        "call_since": None, "calls": 40, "collective_seq": 61,
        "memory": {"rss_bytes": 2**28}, "error": None, "oom": False,
    }  # fmt: skip
    record.update(fields)
    return record


def agent_exit(rank: int, exitcode: int, error: str = "") -> dict:
    from meshforge.launch.local import describe_exit

    return {
        "rank": rank, "local_rank": rank, "pid": 100 + rank, "exitcode": exitcode,
        "exit": describe_exit(exitcode), "error": error or f"Signal {-exitcode} received",
        "log": f"/r/logs/rank-{rank}.log",
    }  # fmt: skip


def make_run(
    root: Path,
    flights: list[dict] = (),
    failures: list[dict] = (),
    agent: list[dict] | None = None,
    report: dict | None = None,
    config: dict | None = None,
    agent_time: float = T0 + 20,
) -> Path:
    run = root / "run"
    health = run / "health"
    health.mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump(config or CONFIG))
    for record in flights:
        (health / f"flight-rank-{record['rank']}.json").write_text(json.dumps(record))
    for record in failures:
        (health / f"failure-rank-{record['rank']}.json").write_text(json.dumps(record))
    if agent is not None:
        first = agent[0] if agent else {}
        (health / "diagnosis.json").write_text(
            json.dumps({"time": agent_time, "first_failure": first, "failures": agent})
        )
    if report is not None:
        (run / "report.json").write_text(json.dumps(report))
    return run


def failed(rank: int, error: str, at: float, **fields) -> dict:
    return flight(rank, status="failed", error=error, time=at, **fields)


# --- what the errors say ---------------------------------------------------------------


@pytest.mark.parametrize(
    "text, kind",
    [
        (RESET, "connection"),
        ("Connection closed by peer [10.0.0.2]:1672", "connection"),
        (
            "DistBackendError: failed to recv, got 0 bytes. Connection was likely closed",
            "connection",
        ),
        ("RuntimeError: Gloo connectFullMesh failed with ... Connection refused", "connection"),
        (TIMEOUT, "timeout"),
        (OOM, "oom"),
        ("RuntimeError: injected crash at step 3 on rank 1", "own"),
        (None, None),
    ],
)
def test_errors_are_told_apart_as_cause_or_consequence(text, kind):
    assert error_kind(text) == kind


# --- failed runs -----------------------------------------------------------------------


def test_rank_killed_by_sigkill_is_a_crash_at_its_peers_step(tmp_path):
    """Its own record was written before it died (step 1); its peer had finished step 3,
    so it got that far; the peer's connection reset is a consequence."""
    run = make_run(
        tmp_path,
        flights=[failed(0, RESET, T0 + 5), flight(1, step=1, time=T0 + 4.9, collective_seq=49)],
        failures=[{"rank": 0, "time": T0 + 5, "error": RESET}],
        agent=[agent_exit(1, -9), agent_exit(0, 1, RESET)],
    )
    d = diagnose_run(run)
    assert (d["verdict"], d["ranks"], d["step"]) == ("rank_crashed", [1], 3)
    assert d["summary"] == (
        "rank 1 (host vm, pid 101) was killed by SIGKILL after step 3 (not by meshforge: the "
        "kernel's OOM killer, an operator or the scheduler)"
    )
    assert any("dmesg" in a for a in d["advice"])


def test_own_error_is_the_crash_whatever_the_agent_saw_first(tmp_path):
    crash = "RuntimeError: injected crash at step 3 on rank 1"
    run = make_run(
        tmp_path,
        flights=[failed(0, RESET, T0 + 5.2), failed(1, crash, T0 + 5, phase="optimizer")],
        failures=[
            {"rank": 1, "time": T0 + 5, "error": crash},
            {"rank": 0, "time": T0 + 5.2, "error": RESET},
        ],
        agent=[agent_exit(0, 1, RESET), agent_exit(1, 1, crash)],
    )
    d = diagnose_run(run)
    assert (d["verdict"], d["ranks"]) == ("rank_crashed", [1])
    assert d["summary"].endswith(f"in optimizer at step 4: {crash}")


def test_segfault_is_a_crash(tmp_path):
    run = make_run(
        tmp_path,
        flights=[failed(0, RESET, T0 + 5), flight(1)],
        agent=[agent_exit(1, -11), agent_exit(0, 1, RESET)],
    )
    d = diagnose_run(run)
    assert (d["verdict"], d["ranks"]) == ("rank_crashed", [1])
    assert "SIGSEGV" in d["summary"]


def test_out_of_memory_names_the_rank_the_phase_and_the_step(tmp_path):
    run = make_run(
        tmp_path,
        flights=[
            failed(0, RESET, T0 + 5.5, step=2),
            failed(1, OOM, T0 + 5, oom=True, phase="forward", step=2, phase_since=T0 + 4.95),
        ],
        failures=[{"rank": 1, "time": T0 + 5, "error": OOM}],
        agent=[agent_exit(0, 1, RESET), agent_exit(1, 1, OOM)],
    )
    d = diagnose_run(run)
    assert (d["verdict"], d["ranks"], d["step"]) == ("oom", [1], 3)
    assert d["summary"] == "rank 1 (host vm, pid 101) ran out of memory in forward at step 3"
    advice = " ".join(d["advice"])
    assert "train.micro_batch (now 4" in advice and "activation_checkpointing: full" in advice


def test_silent_rank_is_the_hang_and_its_peers_waited_for_it(tmp_path):
    """Rank 1 stopped (SIGSTOP) after step 3: its record stops; rank 0 times out 10 s
    later in the next step's all-reduce; the agent SIGKILLs rank 1 in the end."""
    run = make_run(
        tmp_path,
        flights=[
            failed(0, TIMEOUT, T0 + 15),
            flight(1, step=None, phase="start", collective_seq=7, time=T0 + 4),
        ],
        failures=[{"rank": 0, "time": T0 + 15, "error": TIMEOUT}],
        agent=[agent_exit(1, -9), agent_exit(0, 1, TIMEOUT)],
    )
    d = diagnose_run(run)
    assert (d["verdict"], d["ranks"], d["step"]) == ("hang", [1], 3)
    assert d["summary"].startswith("rank 1 (host vm, pid 101) hung after step 3: its flight")
    [wait] = d["evidence"]["waits"]
    assert wait == {"rank": 0, "seq": 61, "phase": "backward", "call": None,
                    "waited_for": [1], "their_seq": [7]}  # fmt: skip
    rows = {r["rank"]: r for r in d["evidence"]["ranks"]}
    assert rows[1]["stale"] and not rows[0]["stale"] and rows[1]["record_age_s"] == 11.0
    assert any("py-spy dump --pid 101" in a for a in d["advice"])


def test_rank_stuck_outside_the_collective_is_the_hang(tmp_path):
    """Its record stays fresh (the writer thread lives) but it never entered the
    collective its peer timed out in."""
    run = make_run(
        tmp_path,
        flights=[
            failed(0, TIMEOUT, T0 + 15),
            flight(1, time=T0 + 14.8, collective_seq=60, phase="data"),
        ],
        agent=[agent_exit(0, 1, TIMEOUT), agent_exit(1, -15)],
    )
    d = diagnose_run(run)
    assert (d["verdict"], d["ranks"]) == ("hang", [1])
    assert "outside the collective" in d["summary"]


def test_every_rank_timing_out_in_one_collective_on_one_host_names_nobody(tmp_path):
    run = make_run(
        tmp_path,
        flights=[failed(0, TIMEOUT, T0 + 15), failed(1, TIMEOUT, T0 + 15.1)],
        agent=[agent_exit(0, 1, TIMEOUT), agent_exit(1, 1, TIMEOUT)],
    )
    d = diagnose_run(run)
    assert (d["verdict"], d["ranks"]) == ("hang", [])
    assert "same collective (seq 61)" in d["summary"]


# --- network partitions ----------------------------------------------------------------


def test_both_sides_timing_out_in_one_collective_is_a_partition(tmp_path):
    run = make_run(
        tmp_path,
        flights=[failed(0, TIMEOUT, T0 + 15, host="h0"), failed(1, TIMEOUT, T0 + 14.5, host="h1")],
        agent=[agent_exit(0, 1, TIMEOUT)],  # the far node's agent never reported
    )
    d = diagnose_run(run)
    assert (d["verdict"], d["ranks"]) == ("network_partition", [1])
    assert d["hosts"] == [{"rank": 1, "host": "h1", "addr": None, "node": None}]
    assert d["summary"].startswith("host h1 became unreachable in backward at step 4")
    assert [w["rank"] for w in d["evidence"]["waits"]] == [0]


def test_partition_is_found_from_the_agent_when_hosts_share_a_name(tmp_path):
    """Namespace hosts share a host name: the agent lists only its own node's ranks."""
    run = make_run(
        tmp_path,
        flights=[failed(0, TIMEOUT, T0 + 15), failed(1, TIMEOUT, T0 + 14.5)],
        agent=[agent_exit(0, 1, TIMEOUT)],
    )
    assert diagnose_run(run)["verdict"] == "network_partition"


def test_far_address_in_the_errors_names_the_cut_host(tmp_path):
    refused = "RuntimeError: Gloo connectFullMesh failed: [10.7.0.3]:40112: Connection refused"
    run = make_run(
        tmp_path,
        flights=[
            failed(0, refused, T0 + 6, host="a", addr="10.7.0.1"),
            failed(1, refused, T0 + 6, host="b", addr="10.7.0.2"),
            flight(2, host="c", addr="10.7.0.3", collective_seq=50, world_size=3),
        ],
        agent=[agent_exit(0, 1, refused), agent_exit(1, 1, refused)],
    )
    d = diagnose_run(run)
    assert (d["verdict"], d["ranks"]) == ("network_partition", [2])
    assert d["summary"].startswith("host c (10.7.0.3) became unreachable")


def test_a_stopped_rank_on_another_host_is_a_hang_not_a_partition(tmp_path):
    """Its agent saw it end (SIGKILL after the stop) and its record lags its peer's
    sequence: one process hung, the network did not fail."""
    run = make_run(
        tmp_path,
        flights=[
            failed(0, TIMEOUT, T0 + 15, host="h0"),
            flight(1, host="h1", time=T0 + 4, collective_seq=7),
        ],
        agent=[agent_exit(1, -9)],
    )
    d = diagnose_run(run)
    assert (d["verdict"], d["ranks"]) == ("hang", [1])


# --- runs that ended, stopped or still run --------------------------------------------


def test_completed_run_is_ok_and_its_restarts_are_told(tmp_path):
    done = [flight(r, status="finished", phase="report", step=8) for r in (0, 1)]
    restarts = [{"attempt": 1, "resumed_from": 4, "reached_before": 5, "steps_redone": 1}]
    report = {"status": "completed", "steps": 8, "restarts": restarts}
    run = make_run(tmp_path, flights=done, report=report)
    d = diagnose_run(run)
    assert (d["verdict"], d["ranks"]) == ("ok", [])
    assert (
        d["summary"]
        == "the run completed 8 steps after 1 restart (resumed from step 4, 1 step(s) redone)"
    )
    assert d["evidence"]["restarts"] == restarts


def test_completed_run_with_a_straggler_names_it(tmp_path):
    done = [flight(r, status="finished", phase="report", step=8) for r in (0, 1)]
    stragglers = [{"rank": 1, "host": "vm", "slowdown": 1.8}]
    report = {"status": "completed", "steps": 8, "stragglers": stragglers}
    run = make_run(tmp_path, flights=done, report=report)
    d = diagnose_run(run)
    assert (d["verdict"], d["ranks"]) == ("straggler", [1])
    assert "1.80x the median" in d["summary"]


def test_stopped_run_says_where_it_resumes(tmp_path):
    done = [flight(r, status="finished", phase="report", step=12) for r in (0, 1)]
    report = {"status": "stopped", "stopped": {"step": 12, "signal": "SIGTERM"}}
    run = make_run(tmp_path, flights=done, report=report)
    d = diagnose_run(run)
    assert (d["verdict"], d["step"]) == ("stopped", 12)
    assert "stopped by SIGTERM after step 12 with a checkpoint" in d["summary"]


def test_a_report_older_than_the_ranks_records_does_not_count(tmp_path):
    """A rerun in the same directory fails: the earlier run's report says completed."""
    run = make_run(
        tmp_path,
        flights=[failed(0, RESET, T0 + 5), flight(1)],
        agent=[agent_exit(1, -9), agent_exit(0, 1, RESET)],
        report={"status": "completed", "steps": 8},
    )
    assert diagnose_run(run)["verdict"] == "rank_crashed"


def test_live_run_is_running_or_names_the_rank_that_went_silent(tmp_path):
    now = time.time()
    fresh = [flight(r, time=now, started=now - 30, last_progress=now - 1) for r in (0, 1)]
    run = make_run(tmp_path, flights=fresh)
    assert diagnose_run(run)["verdict"] == "running"
    silent = [fresh[0], flight(1, time=now - 60, started=now - 90, collective_seq=40)]
    run = make_run(tmp_path / "b", flights=silent)
    d = diagnose_run(run)
    assert (d["verdict"], d["ranks"]) == ("hang", [1])


def test_a_run_whose_lock_is_free_with_no_report_ended_and_was_not_running(tmp_path):
    """Launcher and workers SIGKILLed: no report, no failure, fresh-looking records; the
    free lock says nothing runs there. Its step: the metrics' 15, ahead of the flight's 9."""
    from meshforge.runtime.runlock import hold_run_dir

    now = time.time()
    fresh = [flight(r, time=now, started=now - 30, last_progress=now - 1, step=9) for r in (0, 1)]
    run = make_run(tmp_path, flights=fresh)
    (run / "metrics.jsonl").write_text(json.dumps({"step": 15, "loss": 2.0}) + "\n")
    (run / "checkpoints" / "step-00000010").mkdir(parents=True)
    assert diagnose_run(run)["verdict"] == "running"  # no lock file: cannot be told
    with hold_run_dir(run, job_id="killed"):
        assert diagnose_run(run)["verdict"] == "running"  # held: it runs
    d = diagnose_run(run)
    assert (d["verdict"], d["status"], d["step"]) == ("ended", "ended without a report", 15)
    assert "ended after step 15 without a report" in d["summary"], d["summary"]
    assert "resumes from its newest checkpoint" in d["summary"], d["summary"]


def test_records_of_an_earlier_launch_are_left_out(tmp_path):
    """diagnosis.json and a failure record from before these ranks started."""
    now = time.time()
    fresh = [flight(r, time=now, started=now - 30, last_progress=now - 1) for r in (0, 1)]
    run = make_run(
        tmp_path,
        flights=fresh,
        failures=[{"rank": 1, "time": now - 600, "error": OOM}],
        agent=[agent_exit(1, -9)],
        agent_time=now - 600,
    )
    assert diagnose_run(run)["verdict"] == "running"


def test_a_directory_that_is_not_a_run_is_refused(tmp_path):
    with pytest.raises(NotARunDirectory):
        diagnose_run(tmp_path)
    assert_one_line_error(meshforge(["diagnose", str(tmp_path)], timeout=60), "not a meshforge run")
    missing = tmp_path / "nope"
    assert_one_line_error(meshforge(["diagnose", str(missing)], timeout=60), str(missing))


# --- what the launcher writes, what the command prints --------------------------------


def test_write_diagnosis_keeps_the_agent_record_and_adds_the_verdict(tmp_path):
    run = make_run(tmp_path, flights=[failed(0, RESET, T0 + 5), flight(1)])
    failures = [agent_exit(0, 1, RESET), agent_exit(1, -9)]
    agent = {"time": T0 + 6, "first_failure": failures[1], "failures": failures}
    written = write_diagnosis(run, agent)
    on_disk = json.loads((run / "health" / "diagnosis.json").read_text())
    assert on_disk == written
    assert written["first_failure"]["rank"] == 1 and written["verdict"] == "rank_crashed"


def test_write_diagnosis_never_hides_the_failure(tmp_path):
    agent = {"time": T0, "first_failure": {"rank": 0}, "failures": []}
    written = write_diagnosis(tmp_path / "gone", agent)  # not a run directory
    assert written["first_failure"] == {"rank": 0} and "diagnosis_error" in written


def test_command_prints_the_summary_first_then_evidence_and_advice(tmp_path):
    run = make_run(
        tmp_path,
        flights=[
            failed(0, TIMEOUT, T0 + 15),
            flight(1, step=None, phase="start", collective_seq=7, time=T0 + 4),
        ],
        agent=[agent_exit(1, -9), agent_exit(0, 1, TIMEOUT)],
    )
    proc = meshforge(["diagnose", str(run)], timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == diagnose_run(run)["summary"]
    text = proc.stdout
    assert (
        "verdict: hang" in text and "rank 0 (seq 61, in backward) waited for rank 1 (seq 7)" in text
    )
    assert "Timed out waiting 10000ms" in text and "unbound_buffer.cc" not in text
    assert "advice:" in text and "NCCL_DEBUG=INFO" in text
    as_json = json.loads(meshforge(["diagnose", str(run), "--json"], timeout=60).stdout)
    assert as_json["verdict"] == "hang" and as_json["ranks"] == [1]


def test_a_later_diagnose_agrees_with_the_launchers_record_of_a_stop(tmp_path):
    """The launcher records a stop (SIGTERM, Ctrl-C) after the workers wrote their last
    flight records; `meshforge diagnose` afterwards reads the same verdict from it."""
    import json as _json
    import os as _os

    from meshforge.health.diagnose import diagnose_run

    health = tmp_path / "health"
    health.mkdir()
    now = 1_000_000.0
    for rank in (0, 1):
        flight = health / f"flight-rank-{rank}.json"
        flight.write_text(_json.dumps({
            "rank": rank, "world_size": 2, "host": "h", "pid": 10 + rank, "attempt": 0,
            "status": "failed", "time": now, "started": now - 10, "phase": "optimizer",
            "phase_since": now, "step": 46, "last_progress": now, "error": "KeyboardInterrupt: ",
        }))  # fmt: skip
        _os.utime(flight, (now, now))
    stop = health / "diagnosis.json"
    stop.write_text(_json.dumps({"verdict": "stopped", "stopped_by": "SIGINT"}))
    _os.utime(stop, (now + 5, now + 5))
    assert diagnose_run(tmp_path)["verdict"] == "stopped"
    _os.utime(stop, (now - 5, now - 5))  # an older stop: this run's own records decide
    assert diagnose_run(tmp_path)["verdict"] != "stopped"
