"""A run directory keeps its whole history (issue 15): a finished job stays finished,
the report covers every segment of a run, extending and starting over are explicit, and
a step trained twice has one row per segment, the latest of which every reader takes.

The learning-rate rule under test (docs/checkpoints.md, "The learning rate across
segments"): the schedule's horizon is fixed when a run starts (its first train.steps);
a later train.steps, larger or smaller, keeps it, and steps past it train at the
schedule's last step's learning rate, so it never jumps."""

from __future__ import annotations

import contextlib
import hashlib
import json
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

from helpers import (
    REPO,
    TINY_JOB,
    Job,
    assert_one_line_error,
    meshforge,
    stop_processes,
    training_processes,
)
from meshforge.config import load_config, save_config
from meshforge.errors import ConfigError
from meshforge.launch.ctrl_c import SAME_PRESS_S
from meshforge.launch.rundir import check_earlier_run
from meshforge.observe.metrics import latest_rows, read_jsonl
from meshforge.rundir.files import remove_earlier_run
from meshforge.rundir.segments import close_segment, open_segment, segments_of
from meshforge.train.checkpoint import write_manifest
from meshforge.train.report import write_interrupted_report
from meshforge.train.schedule import lr_factor

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

    # extended to 30 steps: steps 21-30 train at the LR of the 20-step schedule's last step
    extended = job.train(1, "--set", "train.steps=30")
    final_lr = _scheduled_lr(20, horizon=20)
    assert "from step 20 to 30; past step 20" in extended.stdout, extended.stdout
    assert f"stays at its value at step 20, {final_lr:.3g}" in extended.stdout, extended.stdout
    rows = {r["step"]: r for r in latest_rows(_records(job))}
    assert sorted(rows) == list(range(1, 31))
    for step, row in rows.items():
        assert row["lr"] == pytest.approx(_scheduled_lr(step, horizon=20), rel=1e-9), step
    assert [rows[s]["lr"] for s in range(20, 31)] == [pytest.approx(final_lr)] * 11  # no jump
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

    # a smaller train.steps than the run reached: nothing to train, nothing touched
    before = _tree(job.run_dir)
    short = job.train(1, "--set", "train.steps=5")
    lines = (short.stdout + short.stderr).strip().splitlines()
    assert len(lines) == 1 and "has trained to step 10 already" in lines[0], lines
    assert "N > 10" in lines[0] and "--fresh" in lines[0], lines[0]
    assert _tree(job.run_dir) == before

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
    # tokens/s: the median over the last layout's steps (segment 2 ran world 1, ZeRO 0;
    # segment 1 world 2, ZeRO-2: not blended), its first logged interval (its start-up)
    # left out
    rows = latest_rows(records)
    assert report["headline_segments"] == [2]
    steady = [r for r in rows if r["step"] > 11]
    assert report["measured_steps"] == len(steady) == 9
    assert report["tokens_per_s"] == pytest.approx(
        statistics.median(r["tokens_per_s"] for r in steady)
    )
    assert report["steps_trained"] == 20 and report["resumed_from"] == 10
    # a mid-run change of train.steps keeps the horizon the run started with
    assert report["lr_horizon"] == 40
    for row in rows:
        assert row["lr"] == pytest.approx(_scheduled_lr(row["step"], horizon=40), rel=1e-9)

    # report.json gone: the final checkpoint and segments.jsonl still say it finished
    (job.run_dir / "report.json").unlink()
    before = _tree(job.run_dir)
    again = job.train(1, "--set", "train.steps=20")
    lines = (again.stdout + again.stderr).strip().splitlines()
    assert len(lines) == 1 and "has finished its 20 steps" in lines[0], lines
    assert _tree(job.run_dir) == before


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
    timing = report["timing"]  # the workers exited: the launcher filled in when
    assert timing["shutdown_s"] == pytest.approx(timing["exited_at"] - timing["last_step_at"])


def _pending_signals(pid: int) -> int:
    """The signals sent to process PID and not yet handled (it is stopped)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("ShdPnd:"):
            return int(line.split()[1], 16)
    return 0


@pytest.mark.slow
def test_a_second_ctrl_c_kills_the_workers_at_once_and_keeps_the_last_checkpoint(job_factory):
    job = job_factory({"train": {"steps": 100_000}, "checkpoint": {"every": 5, "keep": 2}})
    argv = [sys.executable, "-m", "meshforge", "train", str(job.config_path), "--nproc", "1",
            "--run-dir", str(job.run_dir)]  # fmt: skip
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip
    workers: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + LONG_WAIT_S
        first = job.run_dir / "checkpoints" / "step-00000005" / "manifest.json"
        while not first.exists():
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline, "no checkpoint written"
            time.sleep(0.2)
        workers = training_processes(proc.pid)
        # the workers cannot finish their stop: only a kill ends them. Stopped before the
        # Ctrl-C is sent, so that it waits in them, pending, rather than being handled
        stop_processes(workers)
        proc.send_signal(signal.SIGINT)
        worker = workers[0]
        while not _pending_signals(worker.pid) & (1 << (signal.SIGINT - 1)):
            assert time.monotonic() < deadline, "the launcher never passed Ctrl-C on"
            time.sleep(0.05)  # the launcher has passed the first Ctrl-C on: it waits
        time.sleep(SAME_PRESS_S)  # a second press, not the first one delivered twice
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=LONG_WAIT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        for w in workers:
            with contextlib.suppress(psutil.Error):
                w.kill()
    assert proc.returncode == 130, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert "stopped by SIGINT twice: the workers were killed" in last, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    _, alive = psutil.wait_procs(workers, timeout=LONG_WAIT_S)
    assert not alive
    report = job.report
    assert report["status"] == "interrupted" and report["stopped"]["signal"] == "SIGINT"
    assert report["timing"]["exited_at"] is not None  # this launch's timing, its exit
    newest = max(int(p.name[5:]) for p in (job.run_dir / "checkpoints").glob("step-*"))
    assert report["last_checkpoint"] == newest >= 5
    assert f"resumes from the last checkpoint, at step {newest}" in last, last
    assert (job.run_dir / "checkpoints" / f"step-{newest:08d}" / "manifest.json").is_file()


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


# -- what a launch decides from the run directory, without training -------------------------
def _config(tmp_path: Path, *overrides: str):
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(TINY_JOB))
    return load_config(path, list(overrides))


def _hand_made_run(run_dir: Path, cfg, reached: int, horizon: int, ended: str | None) -> None:
    """A run directory as a run of CFG leaves it: config.yaml, a committed checkpoint at
    step REACHED (schedule horizon HORIZON) and one segment that ended ENDED there (None:
    crashed)."""
    ckpt = run_dir / "checkpoints" / f"step-{reached:08d}"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text(json.dumps({"step": reached, "lr_horizon": horizon}))
    write_manifest(ckpt, reached)
    save_config(cfg, run_dir / "config.yaml")
    layout = {"dp": 1, "tp": 1, "pp": 1, "zero": 0}
    open_segment(run_dir, start_step=0, steps=horizon, lr_horizon=horizon, world_size=1,
                 layout=layout)  # fmt: skip
    if ended is not None:
        close_segment(run_dir, 1, reached, ended, wall_s=1.0)


def test_what_the_newest_checkpoint_reached_decides_whatever_report_json_says(tmp_path):
    run_dir = tmp_path / "run"
    _hand_made_run(run_dir, _config(tmp_path), reached=11, horizon=40, ended="stopped")
    # stopped at 11 of 40: train.steps=10 has nothing to train, and says where it is
    decision = check_earlier_run(_config(tmp_path, "train.steps=10"), run_dir, fresh=False)
    assert "has trained to step 11 already" in decision.finished, decision.finished
    assert "N > 11" in decision.finished and "--fresh" in decision.finished
    # back to its own 40 steps: a plain resume (the workers say so)
    decision = check_earlier_run(_config(tmp_path, "train.steps=40"), run_dir, fresh=False)
    assert (decision.finished, decision.note) == (None, None)
    # past its horizon: the same line an extension prints, the LR past the horizon in it
    decision = check_earlier_run(_config(tmp_path, "train.steps=60"), run_dir, fresh=False)
    final = LR * lr_factor(39, WARMUP, 40, MIN_RATIO)
    assert decision.note.startswith(f"meshforge: resuming the run in {run_dir} from step 11 to 60")
    assert "past step 40, the end of its learning-rate schedule" in decision.note
    assert f"stays at its value at step 40, {final:.3g}" in decision.note

    # finished at 50, report.json deleted: the checkpoint and segments.jsonl say so
    done = tmp_path / "done"
    _hand_made_run(done, _config(tmp_path, "train.steps=50"), 50, 50, ended="completed")
    decision = check_earlier_run(_config(tmp_path, "train.steps=50"), done, fresh=False)
    assert "has finished its 50 steps" in decision.finished, decision.finished
    decision = check_earlier_run(_config(tmp_path, "train.steps=70"), done, fresh=False)
    assert decision.note.startswith(f"meshforge: extending the finished run in {done} from "
                                    "step 50 to 70; past step 50")  # fmt: skip


def test_learning_rate_past_the_horizon_never_jumps():
    # a warm-up as long as the horizon (the README's 20-step run with warmup 20) ends at
    # the peak, and stays there; a decaying schedule stays at its last step's value
    for warmup, horizon in [(20, 20), (30, 20), (5, 20), (0, 1)]:
        last = lr_factor(horizon - 1, warmup, horizon, MIN_RATIO)
        past = [lr_factor(s, warmup, horizon, MIN_RATIO) for s in range(horizon, horizon + 20)]
        assert past == [last] * 20, (warmup, horizon)
    assert lr_factor(19, 20, 20, MIN_RATIO) == 1.0
    assert lr_factor(19, 5, 20, MIN_RATIO) == pytest.approx(MIN_RATIO, abs=0.02)


def test_a_warm_up_as_long_as_the_schedule_is_warned_about_once(tmp_path):
    decision = check_earlier_run(_config(tmp_path, "train.warmup=20"), tmp_path / "new", False)
    assert "train.warmup=20 is not below the learning-rate schedule's 20 steps" in decision.warning
    assert check_earlier_run(_config(tmp_path), tmp_path / "new", False).warning is None


def test_a_folder_that_is_not_a_meshforge_run_is_refused_unless_fresh(tmp_path, job_factory):
    cfg = _config(tmp_path)
    foreign = tmp_path / "theirs"
    foreign.mkdir()
    (foreign / "config.yaml").write_text("learning_rate: 0.1\n")
    (foreign / "metrics.jsonl").write_text('{"epoch": 1}\n')
    (foreign / "report.html").write_text("<p>mine</p>")
    with pytest.raises(ConfigError, match="not a meshforge run directory"):
        check_earlier_run(cfg, foreign, fresh=False)
    assert check_earlier_run(cfg, foreign, fresh=True).finished is None
    (foreign / "config.yaml").unlink()  # metrics without a config: not ours either
    with pytest.raises(ConfigError, match="metrics.jsonl but no config.yaml") as refused:
        check_earlier_run(cfg, foreign, fresh=False)
    # no record of what a run wrote there: --fresh would refuse too, so is not offered
    assert "--fresh" not in str(refused.value)
    # an empty folder, one with files of other kinds or an empty metrics.jsonl (nothing
    # to lose), one that does not exist: new runs
    for name in ("empty", "notes", "no-rows", "absent"):
        fine = tmp_path / name
        if fine.name != "absent":
            fine.mkdir()
        if fine.name == "notes":
            (fine / "notes.txt").write_text("mine")
        if fine.name == "no-rows":
            (fine / "metrics.jsonl").touch()
        assert check_earlier_run(cfg, fine, fresh=False).finished is None
    (tmp_path / "a-file").write_text("mine")
    with pytest.raises(ConfigError, match="is a file, not a directory"):
        check_earlier_run(cfg, tmp_path / "a-file", fresh=True)

    # through the CLI: one line, exit 2, the folder as it was
    (foreign / "config.yaml").write_text("learning_rate: 0.1\n")
    before = _tree(foreign)
    job = job_factory()
    refused = meshforge(["train", str(job.config_path), "--nproc", "1", "--run-dir", str(foreign)])
    line = assert_one_line_error(refused, f"run directory {foreign} is not a meshforge run")
    assert "--fresh" not in line, line  # it would refuse too: removes only what a run wrote
    assert _tree(foreign) == before
    # ... and --fresh says so, leaving no lock file of its own behind
    fresh = ["train", str(job.config_path), "--nproc", "1", "--run-dir", str(foreign), "--fresh"]
    assert_one_line_error(meshforge(fresh), "is not a meshforge run", "nothing removed")
    assert sorted(p.name for p in foreign.iterdir()) == [
        "config.yaml", "metrics.jsonl", "report.html"]  # fmt: skip
    assert (foreign / "config.yaml").read_text() == "learning_rate: 0.1\n"
    # `meshforge report` on it writes its page but adopts none of the user's files as
    # meshforge's: --fresh still refuses, and every file of theirs stays
    assert meshforge(["report", str(foreign)], timeout=60).returncode == 0
    assert_one_line_error(meshforge(fresh), "is not a meshforge run", "nothing removed")
    assert (foreign / "metrics.jsonl").read_text() == '{"epoch": 1}\n'
    assert (foreign / "config.yaml").read_text() == "learning_rate: 0.1\n"


def test_fresh_removes_only_what_meshforge_writes_and_names_what_it_kept(tmp_path):
    run_dir = tmp_path / "run"
    ours = ["config.yaml", "metrics.jsonl", "segments.jsonl", "report.json", "report.html",
            "report.png", ".report.html.host.7.tmp", "checkpoints/step-00000010/manifest.json",
            "checkpoints/.tmp-step-00000020/__0_0.distcp", "logs/rank-0.log",
            "logs/elastic/none_abc/attempt_0/0/error.json", "health/flight-rank-0.json",
            "health/diagnosis.json", "export/step-00000010-torch/model.pt",
            "system/node-0.jsonl", "tensorboard/events.out.tfevents.1.host",
            ".trace/rank-0.json", ".launch/job-host-7.yaml"]  # fmt: skip
    theirs = ["notes.md", "logs/my-notes.txt", "checkpoints/README.txt", "export/mine.txt"]
    for name in ours + theirs:
        (run_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (run_dir / name).write_text(name)
    (run_dir / "checkpoints/step-00000010/manifest.json").write_text('{"files": {}}')
    (run_dir / ".lock").write_text("")
    line = remove_earlier_run(run_dir)
    left = sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*") if p.is_file())
    assert left == sorted([".lock", *theirs])
    assert sorted(p.name for p in run_dir.iterdir()) == [".lock", "checkpoints", "export",
                                                          "logs", "notes.md"]  # fmt: skip
    assert "checkpoints up to step 10" in line, line
    assert ("kept 4 entries meshforge did not write (checkpoints/README.txt, "
            "export/mine.txt, logs/my-notes.txt, notes.md)") in line, line  # fmt: skip
    assert remove_earlier_run(run_dir) is None  # nothing of a run left


def test_report_png_of_a_run_without_metrics_is_skipped_with_a_note(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "report.json").write_text(json.dumps({"status": "interrupted", "name": "t"}))
    proc = meshforge(["report", str(run_dir), "--png"], timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"meshforge: no {run_dir / 'report.png'}: it has no metrics.jsonl (no step was logged)"
    ]
    assert (run_dir / "report.html").is_file() and not (run_dir / "report.png").exists()
