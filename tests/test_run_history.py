"""A run directory keeps its whole history (issue 15): a finished job stays finished,
the report covers every segment of a run, extending and starting over are explicit, and
a step trained twice has one row per segment, the latest of which every reader takes.

The learning-rate rule under test (README, "Checkpoints and resuming"): the schedule's
horizon is fixed when a run starts (its first train.steps); a later train.steps, larger
or smaller, keeps it, and steps past it train at lr x min_lr_ratio."""

from __future__ import annotations

import hashlib
import json
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import REPO, TINY_JOB, Job, assert_one_line_error
from meshforge.observe.metrics import latest_rows, read_jsonl
from meshforge.train.report import write_interrupted_report
from meshforge.train.schedule import lr_factor
from meshforge.train.segments import close_segment, open_segment, segments_of

LR, WARMUP, MIN_RATIO = TINY_JOB["train"]["lr"], TINY_JOB["train"]["warmup"], 0.1
JOB = {"train": {"steps": 20}, "checkpoint": {"every": 10, "keep": 3}}
LONG_WAIT_S = 240  # a bound for a stuck run, never a performance threshold


def _tree(root: Path) -> dict[str, tuple[str, int]]:
    """Every file and folder under ROOT, ROOT and hidden ones included: a file's sha256,
    a folder's mark, and the modification time (a folder's changes with its entries)."""

    def entry(p: Path) -> tuple[str, int]:
        what = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "folder"
        return what, p.stat().st_mtime_ns

    return {str(p.relative_to(root)): entry(p) for p in [root, *sorted(root.rglob("*"))]}


def _records(job: Job) -> list[dict]:
    return read_jsonl(job.run_dir / "metrics.jsonl")


def _checkpoints(job: Job) -> list[str]:
    return sorted(p.name for p in (job.run_dir / "checkpoints").iterdir())


def _spans(report: dict) -> list[tuple]:
    return [(s["start_step"], s["end_step"], s["ended"]) for s in report["segments"]]


def _scheduled_lr(step: int, horizon: int) -> float:
    return LR * lr_factor(step - 1, WARMUP, horizon, MIN_RATIO)


@pytest.mark.slow
def test_a_finished_run_stays_finished_is_extended_explicitly_and_starts_over_fresh(
    job_factory,
):
    job = job_factory(JOB)
    job.train(1)
    first = job.report

    # the same command again: one line, exit 0, not a byte or a timestamp changed
    before = _tree(job.run_dir)
    again = job.train(1)
    lines = (again.stdout + again.stderr).strip().splitlines()
    assert len(lines) == 1, again.stdout + again.stderr
    for fragment in ("finished its 20 steps", str(job.run_dir / "report.json"),
                     "--set train.steps=N with N > 20", "--fresh"):  # fmt: skip
        assert fragment in lines[0], lines[0]
    assert _tree(job.run_dir) == before

    # extended to 30 steps: steps 21-30 train at the 20-step schedule's final LR
    extended = job.train(1, "--set", "train.steps=30")
    assert "extending the finished run" in extended.stdout, extended.stdout
    rows = {r["step"]: r for r in latest_rows(_records(job))}
    assert sorted(rows) == list(range(1, 31))
    for step, row in rows.items():
        assert row["lr"] == pytest.approx(_scheduled_lr(step, horizon=20), rel=1e-9), step
    assert [rows[s]["lr"] for s in range(21, 31)] == [pytest.approx(LR * MIN_RATIO)] * 10
    assert rows[20]["lr"] >= rows[21]["lr"]  # no jump back up
    report = job.report
    assert report["status"] == "completed" and report["steps"] == 30
    assert report["lr_horizon"] == 20
    assert report["first_loss"] == rows[1]["loss"] == first["first_loss"]
    assert report["final_loss"] == rows[30]["loss"]
    assert report["measured_steps"] == 28  # 30 logged steps, less each segment's first
    assert report["steps_trained"] == 30
    assert _spans(report) == [(0, 20, "completed"), (20, 30, "completed")]
    assert "steps 21-30 on 1 rank" in extended.stdout  # the summary table lists them

    # another model shape: refused in one line naming the fields; nothing written
    before = _tree(job.run_dir)
    refused = job.train(1, "--set", "model.d_model=64", "--set", "model.n_layers=3", check=False)
    assert_one_line_error(refused, "model.d_model 32 -> 64", "model.n_layers 2 -> 3", "--fresh")
    assert _tree(job.run_dir) == before

    # --fresh: the earlier run's files go, the new model trains from step 1
    fresh = job.train(1, "--set", "model.d_model=64", "--fresh")
    assert "--fresh: removed the earlier run" in fresh.stdout, fresh.stdout
    report = job.report
    assert report["resumed_from"] is None and len(report["segments"]) == 1
    assert report["model_params"] > first["model_params"]
    assert [r["step"] for r in _records(job)] == list(range(1, 21))
    assert _checkpoints(job) == ["step-00000010", "step-00000020"]  # step 30's is gone


@pytest.mark.slow
def test_a_run_killed_after_its_step_10_checkpoint_and_resumed_reads_as_one_run(job_factory):
    """Killed on 2 ranks under ZeRO-2, resumed on 1 rank under plain DDP with a shorter
    train.steps (40 -> 20): one report over both segments, the horizon kept at 40."""
    job = job_factory({**JOB, "train": {"steps": 40}, "parallel": {"zero": 2}})
    killed = job.train(2, env={"MESHFORGE_FAULT": "kill_after_checkpoint:10"}, check=False)
    assert killed.returncode == 1, killed.stderr[-2000:]
    assert job.report["status"] == "failed"
    assert _spans(job.report) == [(0, 10, "crashed")]  # no clean end: listed as crashed

    job.train(1, "--set", "train.steps=20", "--set", "parallel.zero=0")
    report = job.report
    records = _records(job)
    assert (records[0]["step"], records[0]["segment"]) == (1, 1)
    assert report["first_loss"] == records[0]["loss"]
    segments = report["segments"]
    seen = [(s["segment"], s["start_step"], s["end_step"], s["world_size"], s["ended"])
            for s in segments]  # fmt: skip
    assert seen == [(1, 0, 10, 2, "crashed"), (2, 10, 20, 1, "completed")]
    assert [s["layout"]["zero"] for s in segments] == [2, 0]
    # tokens/s: the median over both segments' steps, each segment's first logged
    # interval (its start-up) left out
    rows = latest_rows(records)
    steady = [r for r in rows if r["step"] not in (1, 11)]
    assert report["measured_steps"] == len(steady) == 18
    assert report["tokens_per_s"] == pytest.approx(
        statistics.median(r["tokens_per_s"] for r in steady)
    )
    assert report["steps_trained"] == 20 and report["resumed_from"] == 10
    # a mid-run change of train.steps keeps the horizon the run started with
    assert report["lr_horizon"] == 40
    for row in rows:
        assert row["lr"] == pytest.approx(_scheduled_lr(row["step"], horizon=40), rel=1e-9)


@pytest.mark.slow
def test_ctrl_c_on_the_launcher_leaves_a_stopped_report_and_a_segment(job_factory):
    job = job_factory({"train": {"steps": 100_000}, "observe": {"log_every": 20}})
    argv = [sys.executable, "-m", "meshforge", "train", str(job.config_path), "--nproc", "1",
            "--run-dir", str(job.run_dir)]  # fmt: skip
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip
    try:
        deadline = time.monotonic() + LONG_WAIT_S
        metrics = job.run_dir / "metrics.jsonl"
        while not (metrics.exists() and metrics.stat().st_size):
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline, "training never started"
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=LONG_WAIT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, err[-3000:]
    report = job.report
    assert report["status"] == "stopped", report.get("status")
    step = report["stopped"]["step"]
    assert report["stopped"]["signal"] == "SIGINT"
    assert (job.run_dir / "checkpoints" / f"step-{step:08d}" / "manifest.json").is_file()
    assert _spans(report) == [(0, step, "stopped")]
    assert f"checkpoint at step {step}" in err.strip().splitlines()[-1]


# -- the records, without training --------------------------------------------------------
def _row(step: int, segment: int | None, loss: float, tokens: float = 100.0) -> dict:
    row = {"step": step, "loss": loss, "tokens_per_s": tokens, "time": 1000.0 + step}
    return row if segment is None else {**row, "segment": segment}


def test_the_latest_segment_row_of_a_step_wins_whole():
    records = [
        _row(1, 1, 5.0),
        {**_row(2, 1, 4.0), "val_loss": 4.5},
        _row(3, 1, 3.0),
        _row(4, 1, 2.0),  # segment 1 crashed here; segment 2 resumed from step 1
        _row(2, 2, 3.9),
        _row(3, 2, 2.9),  # and was stopped here
    ]
    rows = latest_rows(records)
    # step 4 of segment 1 is abandoned history: segment 2 trained on from step 1
    assert [(r["step"], r["segment"], r["loss"]) for r in rows] == [(1, 1, 5.0), (2, 2, 3.9),
                                                                   (3, 2, 2.9)]  # fmt: skip
    assert "val_loss" not in rows[1]  # no value of the earlier row survives
    # rows without a segment (older runs) merge per step as they always did
    legacy = latest_rows([{"step": 3, "loss": 2.0}, {"step": 3, "val_loss": 2.1}])
    assert legacy == [{"step": 3, "loss": 2.0, "val_loss": 2.1}]


def test_open_segments_are_crashed_or_restarted_and_end_at_their_last_row(tmp_path):
    layout = {"dp": 2, "tp": 1, "pp": 1, "zero": 0}
    common = {"steps": 9, "lr_horizon": 9, "world_size": 2, "layout": layout}
    assert open_segment(tmp_path, start_step=0, run_id="a", attempt=0, **common) == 1
    assert open_segment(tmp_path, start_step=2, run_id="a", attempt=1, **common) == 2  # restart
    assert open_segment(tmp_path, start_step=4, run_id="b", attempt=0, **common) == 3
    close_segment(tmp_path, 3, 9, "completed", wall_s=2.0)
    rows = [_row(s, 1, 1.0) for s in (1, 2, 3)] + [_row(s, 2, 1.0) for s in (3, 4, 5)]
    got = [(s["start_step"], s["end_step"], s["ended"]) for s in segments_of(tmp_path, rows)]
    assert got == [(0, 3, "restarted"), (2, 5, "crashed"), (4, 9, "completed")]


def test_an_interrupted_launch_reports_the_whole_run_and_closes_its_segment(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    layout = {"dp": 1, "tp": 1, "pp": 1, "zero": 0}
    open_segment(run_dir, start_step=0, steps=50, lr_horizon=50, world_size=1, layout=layout)
    rows = [_row(s, 1, 6.0 - s / 10, tokens=100.0 * s) for s in range(1, 6)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert write_interrupted_report(run_dir, "SIGINT", time.time() - 60, "tiny", 50)
    report = json.loads((run_dir / "report.json").read_text())
    assert report["status"] == "interrupted" and report["stopped"]["signal"] == "SIGINT"
    assert (report["first_loss"], report["final_loss"]) == (5.9, 5.5)
    assert report["tokens_per_s"] == 350.0  # steps 2-5: the first includes start-up
    assert _spans(report) == [(0, 5, "stopped")]
