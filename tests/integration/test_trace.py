"""`meshforge train --trace STEPS`: one Chrome/Perfetto timeline of the chosen steps,
every rank's compute and communication on one clock, in RUN_DIR/trace.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import assert_one_line_error, meshforge
from meshforge.config import parse_steps
from meshforge.observe.trace import event_kind, merge_traces, steps_text

SIX_STEPS = {"train": {"steps": 6}}


def _spans(events: list[dict], rank: int) -> dict[int, dict]:
    return {
        e["args"]["step"]: e
        for e in events
        if e["ph"] == "X" and e["pid"] == rank and e["args"]["kind"] == "step"
    }


def _within(event: dict, span: dict) -> bool:
    return span["ts"] <= event["ts"] and event["ts"] + event["dur"] <= span["ts"] + span["dur"]


def test_a_traced_run_writes_one_timeline_of_every_rank(job_factory):
    job = job_factory(SIX_STEPS)
    proc = job.train(2, "--trace", "3-4")
    assert "timeline of steps 3-4" in proc.stdout
    doc = json.loads((job.run_dir / "trace.json").read_text())
    assert isinstance(doc, dict) and isinstance(doc["traceEvents"], list)
    assert isinstance(doc["baseTimeNanoseconds"], int)  # when ts 0 was, in Unix time
    events = doc["traceEvents"]
    for e in events:  # trace-event JSON: what Perfetto and chrome://tracing read
        assert {"ph", "pid", "name"} <= set(e), e
        if e["ph"] == "X":
            assert e["ts"] >= 0 and e["dur"] >= 0, e
            assert e["args"]["kind"] in ("compute", "communication", "step"), e
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert sorted(names) == [0, 1]
    assert all(names[r].startswith(f"rank {r} (") for r in names)
    spans = {rank: _spans(events, rank) for rank in (0, 1)}
    for rank in (0, 1):
        assert sorted(spans[rank]) == [3, 4], f"rank {rank}"
        mine = [e for e in events if e["ph"] == "X" and e["pid"] == rank]
        for step in (3, 4):
            kinds = {e["args"]["kind"] for e in mine if _within(e, spans[rank][step])}
            assert {"compute", "communication"} <= kinds, f"rank {rank} step {step}: {kinds}"
    # one clock: the ranks all-reduce inside each step, so their spans of it overlap
    for step in (3, 4):
        a, b = spans[0][step], spans[1][step]
        assert a["ts"] < b["ts"] + b["dur"] and b["ts"] < a["ts"] + a["dur"], (a, b)
    assert not (job.run_dir / ".trace").exists()  # the rank files were merged


def test_an_untraced_run_writes_no_timeline(job_factory):
    job = job_factory({"train": {"steps": 2}})
    job.train(1)
    assert (job.run_dir / "report.json").exists()
    assert not (job.run_dir / "trace.json").exists()
    assert not (job.run_dir / ".trace").exists()


@pytest.mark.parametrize(
    ("spec", "named"),
    [("3-x", "'3-x' is not a step"), ("0", "count from 1"), ("5-3", "ends before"),
     ("7", "beyond train.steps=6")],
)  # fmt: skip
def test_a_bad_steps_spec_is_one_line_before_any_worker_starts(job_factory, spec, named):
    job = job_factory(SIX_STEPS)
    proc = job.train(2, "--trace", spec, check=False)
    assert_one_line_error(proc, "observe.trace_steps", named)
    assert not job.run_dir.exists()


def test_train_help_shows_the_trace_flag():
    proc = meshforge(["train", "--help"])
    assert proc.returncode == 0, proc.stderr
    assert "--trace STEPS" in proc.stdout
    assert "observe.trace_steps" in proc.stdout


# -- the pure parts -------------------------------------------------------------------


def test_steps_spec_reads_single_steps_ranges_and_lists():
    assert parse_steps("") == []
    assert parse_steps("5") == [5]
    assert parse_steps(" 5-7 ") == [5, 6, 7]
    assert parse_steps("9,5, 6-7") == [5, 6, 7, 9]
    assert steps_text([3, 4, 5, 9]) == "3-5, 9"
    for bad in ("x", "5,", "-3", "3-", "1.5", "0-2"):
        with pytest.raises(ValueError):
            parse_steps(bad)


def test_steps_spec_in_the_job_file_may_be_a_number():
    from meshforge.config import build_config

    assert build_config({"observe": {"trace_steps": 5}}).observe.trace_steps == "5"


@pytest.mark.parametrize(
    ("name", "kind"),
    [("c10d::allreduce_", "communication"), ("gloo:all_reduce", "communication"),
     ("nccl:all_gather", "communication"), ("ncclDevKernel_AllReduce_Sum_f32", "communication"),
     ("_c10d_functional::wait_tensor", "communication"), ("c10d::send", "communication"),
     ("gloo:recv", "communication"), ("FSDP::all_gather (blocks.0)", "communication"),
     ("FSDP::post_backward_reduce", "communication"), ("record_param_comms", "communication"),
     ("aten::mm", "compute"), ("aten::broadcast_tensors", "compute"),
     ("Optimizer.step#AdamW.step", "compute"), ("sm90_xmma_gemm_f32f32", "compute")],
)  # fmt: skip
def test_events_are_told_apart_as_communication_or_compute(name, kind):
    assert event_kind(name) == kind


def _rank_file(run_dir: Path, rank: int, base_ns: int, events: list[dict]) -> None:
    doc = {"rank": rank, "host": f"h{rank}", "pid": 100 + rank, "steps": [1],
           "baseTimeNanoseconds": base_ns, "traceEvents": events}  # fmt: skip
    (run_dir / ".trace").mkdir(exist_ok=True)
    (run_dir / ".trace" / f"rank-{rank}.json").write_text(json.dumps(doc))


def test_merge_puts_every_rank_on_the_earliest_base_clock(tmp_path):
    def events(pid: int) -> list[dict]:
        return [
            {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": "x"}},
            {"ph": "X", "cat": "user_annotation", "name": "step 1", "pid": pid, "tid": pid,
             "ts": 1000.0, "dur": 50.0, "args": {}},
            {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": pid, "tid": pid,
             "ts": 1010.0, "dur": 5.0, "args": {"Ev Idx": 3}},
            {"ph": "X", "cat": "cpu_op", "name": "aten::view", "pid": pid, "tid": pid,
             "ts": 1011.0, "dur": 0.2, "args": {}},
            {"ph": "X", "cat": "kernel", "name": "ncclKernel_AllReduce", "pid": 0, "tid": 7,
             "ts": 1020.0, "dur": 9.0, "args": {}},
            {"ph": "X", "cat": "Trace", "name": "PyTorch Profiler (0)", "pid": "Spans",
             "tid": "PyTorch Profiler", "ts": 990.0, "dur": 100.0},
            {"ph": "i", "s": "g", "name": "Record Window End", "pid": "", "tid": "",
             "ts": 1100.0},
        ]  # fmt: skip

    _rank_file(tmp_path, 0, 5_000_000, events(100))  # rank 1's base is 2 ms later
    _rank_file(tmp_path, 1, 7_000_000, events(101))
    out = merge_traces(tmp_path, 2)
    assert out == tmp_path / "trace.json"
    doc = json.loads(out.read_text())
    assert doc["baseTimeNanoseconds"] == 5_000_000 + 1_000_000  # ts 0: rank 0's step
    assert doc["otherData"]["missing_ranks"] == []
    xs = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    step = {e["pid"]: e["ts"] for e in xs if e["name"] == "step 1"}
    assert step == {0: 0.0, 1: 2000.0}
    assert {e["pid"] for e in doc["traceEvents"]} == {0, 1}  # kineto's own spans are gone
    assert not [e for e in xs if e["name"] == "aten::view"]  # under a microsecond
    mm = next(e for e in xs if e["name"] == "aten::mm")
    assert mm["args"] == {"kind": "compute"}
    kernel = next(e for e in xs if e["name"].startswith("nccl") and e["pid"] == 1)
    assert kernel["args"]["kind"] == "communication"
    streams = [e for e in doc["traceEvents"] if e["name"] == "thread_name" and e["pid"] == 1]
    assert [s["tid"] for s in streams] == [kernel["tid"]]
    assert streams[0]["args"]["name"] == "GPU 0 stream 7"
    assert not (tmp_path / ".trace").exists()


def test_merge_names_a_rank_whose_file_is_elsewhere(tmp_path):
    span = {"ph": "X", "cat": "user_annotation", "name": "step 1", "pid": 100, "tid": 1,
            "ts": 10.0, "dur": 5.0, "args": {}}  # fmt: skip
    _rank_file(tmp_path, 0, 0, [span])
    doc = json.loads(merge_traces(tmp_path, 2).read_text())
    assert doc["otherData"]["missing_ranks"] == [1]
    assert (tmp_path / ".trace" / "rank-0.json").exists()  # kept: merged again later
    assert merge_traces(tmp_path / "nothing", 2) is None
