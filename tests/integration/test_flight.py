"""The flight record (observe/flight.py), the straggler judgement and the stop control,
in process: what a rank records and when, without a training run."""

from __future__ import annotations

import json
import time

import pytest
import torch
import torch.distributed as dist

from meshforge.observe.flight import FlightRecorder, is_oom, read_flight_records
from meshforge.observe.straggler import StragglerWatch


def test_record_is_written_at_start_on_failure_and_at_close(tmp_path):
    rec = FlightRecorder(tmp_path, rank=3, world_size=4, every_s=60).start()
    first = json.loads((tmp_path / "health" / "flight-rank-3.json").read_text())
    assert (first["rank"], first["status"], first["phase"]) == (3, "running", "start")
    rec.set_phase("forward")
    rec.progress(7)
    rec.fail(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    failed = read_flight_records(tmp_path / "health")[0]
    assert failed["status"] == "failed" and failed["oom"] is True
    assert (failed["phase"], failed["step"]) == ("forward", 7)
    assert failed["memory"]["rss_bytes"] > 0
    rec.close("finished")
    assert read_flight_records(tmp_path / "health")[0]["status"] == "failed"  # kept


def test_background_thread_keeps_the_record_fresh(tmp_path):
    rec = FlightRecorder(tmp_path, rank=0, world_size=1, every_s=0.05).start()
    try:
        t0 = json.loads(rec.path.read_text())["time"]
        rec.progress(5)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            record = json.loads(rec.path.read_text())
            if record["time"] > t0 and record["step"] == 5:
                break
            time.sleep(0.05)
        assert record["step"] == 5 and record["time"] > t0
    finally:
        rec.close("finished")
    assert json.loads(rec.path.read_text())["status"] == "finished"


def test_previous_attempt_is_read_before_it_is_replaced(tmp_path):
    rec = FlightRecorder(tmp_path, rank=0, world_size=1, every_s=60).start()
    rec.progress(9)
    rec.close("failed")
    again = FlightRecorder(tmp_path, rank=0, world_size=1, every_s=60)
    assert again.previous["step"] == 9


def test_out_of_memory_is_recognised():
    assert is_oom(torch.OutOfMemoryError("x"))
    assert is_oom(RuntimeError("DefaultCPUAllocator: can't allocate memory: out of memory"))
    assert not is_oom(RuntimeError("Connection reset by peer"))


def _count_calls(run_dir: str) -> dict:
    rec = FlightRecorder(run_dir, dist.get_rank(), dist.get_world_size(), every_s=60).start()
    before = rec.snapshot()
    t = torch.ones(4)
    dist.all_reduce(t)
    dist.broadcast(t, src=0)
    dist.barrier()
    after = rec.snapshot()
    rec.close("finished")
    return {
        "calls": after["calls"] - before["calls"],
        "seq": (after["collective_seq"] or 0) - (before["collective_seq"] or 0),
        "inside": after["call"],
    }


def test_distributed_calls_and_the_group_sequence_are_counted(gloo, tmp_path):
    for result in gloo.run(2, _count_calls, str(tmp_path)):
        assert result["calls"] == 3  # all_reduce, broadcast, barrier through torch.distributed
        assert result["seq"] >= 3  # the group's own count (barrier may add its own)
        assert result["inside"] is None  # not inside a call once it returned


@pytest.mark.parametrize(
    "rounds, named",
    [
        ([[1.0, 1.0, 1.0, 2.0]] * 2, [3]),  # twice above the median: named
        ([[1.0, 1.0, 1.0, 2.0], [1.0, 1.0, 1.0, 1.0]], []),  # once: not yet
        ([[1.0, 1.1, 0.95, 1.05]] * 5, []),  # noise within the margin
    ],
)
def test_straggler_needs_consecutive_intervals_above_the_margin(rounds, named):
    watch = StragglerWatch(world_size=4, margin=0.25, intervals=2)
    result = []
    for per_rank in rounds:
        result = watch.judge(per_rank)
    assert result == named
    if named:
        assert watch.named[3] == pytest.approx(2.0)


def test_point_to_point_functions_keep_their_identity(tmp_path):
    """P2POp accepts only torch.distributed.isend/irecv themselves (pipelining uses it)."""
    rec = FlightRecorder(tmp_path, rank=0, world_size=1, every_s=60).start()
    try:
        assert not hasattr(dist.isend, "__wrapped__")
        assert not hasattr(dist.irecv, "__wrapped__")
        assert hasattr(dist.all_reduce, "__wrapped__")  # collectives are counted
    finally:
        rec.close("finished")
