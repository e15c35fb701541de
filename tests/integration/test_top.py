"""`meshforge top RUN_DIR`: a live view of a run read only from its run directory.

The CLI runs in a real pseudo-terminal (reads bounded by select and deadlines) on a
finished tiny run and on one still training; `render_frame` is checked on hand-made run
directories: files missing, lines cut short, a silent rank."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from helpers import REPO, Job, assert_one_line_error, meshforge
from meshforge.observe.metrics import tail_rows
from meshforge.report.top import read_run, render_frame
from meshforge.runtime.runlock import hold_run_dir, is_held

CLEAR = "\x1b[H\x1b[2J"
NOW = time.time()  # report.json's mtime is compared with the records' times


# -- a pseudo-terminal ---------------------------------------------------------------------
class PtyCommand:
    """`meshforge ARGS` with a pseudo-terminal (110 x 50) as stdin, stdout and stderr."""

    def __init__(self, args: list[str]) -> None:
        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 110, 0, 0))
        env = {k: v for k, v in os.environ.items() if k not in ("MESHFORGE_FAULT", "COLUMNS")}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "meshforge", *args],
            stdin=slave,
            stdout=slave,
            stderr=slave,
            cwd=REPO,
            env=env,
            start_new_session=True,
        )
        os.close(slave)
        self.master, self.text, self.eof = master, "", False

    def read(self, until=lambda text: False, timeout: float = 30.0) -> bool:
        """Read until `until(all text so far)` holds (True), end of output or the timeout."""
        deadline = time.monotonic() + timeout
        while not self.eof and not until(self.text):
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            ready, _, _ = select.select([self.master], [], [], min(left, 0.5))
            if not ready:
                continue
            try:
                data = os.read(self.master, 65536)
            except OSError:  # EIO: the child closed its side
                data = b""
            if not data:
                self.eof = True
            self.text += data.decode(errors="replace").replace("\r\n", "\n")
        return until(self.text)

    @property
    def frames(self) -> list[str]:
        return [f for f in self.text.split(CLEAR) if f.strip()]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        os.close(self.master)


def _rank_lines(frame: str) -> dict[int, list[str]]:
    """Rank -> its row's cells (split on runs of spaces) in the frame's rank table."""
    table = frame.split("\nrank ", 1)[1].split("\n\n")[0] if "\nrank " in frame else ""
    return {
        int(line.split()[0]): line.split()
        for line in table.splitlines()[1:]
        if re.match(r"\d+ ", line)
    }


# -- runs made by the CLI --------------------------------------------------------------------
@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    job = Job(tmp_path_factory.mktemp("top-finished"))
    job.train(2)
    return job.run_dir


def test_top_on_a_terminal_draws_a_finished_run_and_exits_by_itself(finished_run: Path):
    top = PtyCommand(["top", str(finished_run), "--interval", "0.5"])
    try:
        assert top.read(lambda text: False, timeout=30) is False and top.eof, top.text
        assert top.proc.wait(timeout=10) == 0, top.text
    finally:
        top.close()
    assert CLEAR in top.text and "Traceback" not in top.text
    frame = top.frames[-1]
    assert "status completed" in frame and "step 20/20" in frame, frame
    ranks = _rank_lines(frame)
    assert sorted(ranks) == [0, 1], frame
    assert all(cells[2] == "20" for cells in ranks.values()), frame


def test_top_once_off_a_terminal_prints_one_plain_frame(finished_run: Path):
    proc = meshforge(["top", str(finished_run), "--once"], timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "\x1b" not in proc.stdout
    assert proc.stdout.count("meshforge top:") == 1
    assert "status completed" in proc.stdout and "loss " in proc.stdout


def test_top_refuses_what_is_not_a_run_directory(tmp_path: Path):
    assert_one_line_error(meshforge(["top", str(tmp_path / "nope")]), "no such run directory")
    assert_one_line_error(meshforge(["top", str(tmp_path)]), "not a meshforge run directory")


def test_top_follows_a_running_run_until_it_ends(tmp_path: Path):
    job = Job(
        tmp_path,
        {"train": {"steps": 24}, "observe": {"flight_every_s": 0.5}, "checkpoint": {"every": 0}},
    )
    logs = open(tmp_path / "train.log", "w")  # noqa: SIM115 - closed in finally
    env = {**os.environ, "MESHFORGE_FAULT": "slow:0:20"}  # ~0.3 s a step on rank 0
    args = ["train", str(job.config_path), "--nproc", "2", "--run-dir", str(job.run_dir)]
    train = subprocess.Popen(
        [sys.executable, "-m", "meshforge", *args], stdout=logs, stderr=logs, cwd=REPO, env=env
    )
    top = None
    try:
        deadline = time.monotonic() + 60
        while not (job.run_dir / "config.yaml").exists() and time.monotonic() < deadline:
            assert train.poll() is None, (tmp_path / "train.log").read_text()
            time.sleep(0.1)
        top = PtyCommand(["top", str(job.run_dir), "--interval", "0.5"])

        def running_frame(text: str) -> bool:
            for frame in text.split(CLEAR):
                ranks = _rank_lines(frame)
                if "status running" in frame and sorted(ranks) == [0, 1]:
                    if all(c[2].isdigit() and "running" in c for c in ranks.values()):
                        return True
            return False

        assert top.read(running_frame, timeout=60), top.text[-3000:]
        assert train.wait(timeout=120) == 0, (tmp_path / "train.log").read_text()[-3000:]
        top.read(timeout=30)  # the run has ended: top draws it and exits by itself
        assert top.eof, top.text[-3000:]
        assert top.proc.wait(timeout=10) == 0
    finally:
        if train.poll() is None:
            train.terminate()  # the launcher stops its workers on SIGTERM
            train.wait(timeout=60)
        if top is not None:
            top.close()
        logs.close()
    last = top.frames[-1]
    assert "status completed" in last and "step 24/24" in last, last
    assert "Traceback" not in top.text


def test_ctrl_c_ends_top_quietly(tmp_path: Path):
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"name": "waiting"}))
    top = PtyCommand(["top", str(tmp_path), "--interval", "0.2"])
    try:
        assert top.read(lambda text: "status not started" in text, timeout=30), top.text
        os.kill(top.proc.pid, signal.SIGINT)
        top.read(timeout=15)
        assert top.proc.wait(timeout=10) == 0, top.text
    finally:
        top.close()
    assert "Traceback" not in top.text and "aborted" not in top.text


# -- hand-made run directories --------------------------------------------------------------
def _config(run_dir: Path, steps: int = 40, flight_every_s: float = 0.5) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = {"name": "hand", "train": {"steps": steps}, "observe": {"flight_every_s": flight_every_s}}
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg))


def _flight(run_dir: Path, rank: int, **fields) -> None:
    record = {
        "rank": rank,
        "world_size": 2,
        "host": f"host{rank}",
        "status": "running",
        "time": NOW - 0.2,
        "started": NOW - 100,
        "phase": "forward_backward",
        "phase_since": NOW - 1.5,
        "step": 12,
        "step_time_s": 0.25,
        "steps": 40,
        "memory": {"rss_bytes": 300 * 2**20},
        **fields,
    }
    (run_dir / "health").mkdir(parents=True, exist_ok=True)
    (run_dir / "health" / f"flight-rank-{rank}.json").write_text(json.dumps(record))


def _metrics(run_dir: Path, rows: list[dict], tail: str = "") -> None:
    text = "".join(json.dumps(r) + "\n" for r in rows) + tail
    (run_dir / "metrics.jsonl").write_text(text)


def _row(step: int, **fields) -> dict:
    return {
        "step": step,
        "time": NOW - (12 - step),
        "loss": 3.5,
        "tokens_per_s": 1234.0,
        "mfu": 0.021,
        "step_time_s": 0.25,
        **fields,
    }


def _sample(net: dict, gpus: list | None = None, **fields) -> dict:
    return {
        "time": NOW - 1,
        "host": "host0",
        "node": 0,
        "cpu_percent": 42.0,
        "mem_used_bytes": 3 * 2**30,
        "mem_total_bytes": 16 * 2**30,
        "net": net,
        "gpus": gpus or [],
        **fields,
    }


def _iface(rx: float, tx: float, utilization: float | None = None) -> dict:
    return {
        "rx_bytes_per_s": rx,
        "tx_bytes_per_s": tx,
        "capacity_bytes_per_s": None,
        "utilization": utilization,
    }


@pytest.fixture
def run_dir(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "run"
    _config(path)
    yield path


def test_a_run_dir_with_nothing_but_its_config_is_not_started(run_dir: Path):
    view = read_run(run_dir, now=NOW)
    assert view.status == "not started" and not view.ended
    frame = render_frame(run_dir, now=NOW)
    assert "status not started" in frame and "step n/a/40" in frame
    assert "loss n/a" in frame and "ranks: n/a" in frame and "hosts: n/a" in frame


def test_half_written_files_show_what_is_whole_and_n_a_for_the_rest(run_dir: Path):
    _flight(run_dir, 0)
    (run_dir / "health" / "flight-rank-1.json").write_text('{"rank": 1, "status": "runn')
    _metrics(run_dir, [_row(10, loss=3.9), _row(11, loss=3.7)], tail='{"step": 12, "lo')
    (run_dir / "system").mkdir()
    sample = json.dumps(_sample({"eth0": _iface(2**20, 2**21)}))
    (run_dir / "system" / "node-0.jsonl").write_text(sample + "\n" + sample[:40])
    (run_dir / "system" / "node-1.jsonl").write_text('{"time": 1, "cpu_perc')
    (run_dir / "report.json").write_text('{"status": "compl')
    frame = render_frame(run_dir, now=NOW)
    assert "status running" in frame and "loss 3.7000" in frame, frame
    ranks = _rank_lines(frame)
    assert ranks[0][2] == "12" and "forward_backward" in ranks[0]
    assert "unreadable" in " ".join(ranks[1]), frame
    host_lines = frame.split("\nhost ", 1)[1].splitlines()
    assert "42%" in host_lines[1] and "1.0 MiB/s" in host_lines[1], frame
    assert "n/a" in host_lines[2], frame


def test_a_running_rank_whose_record_is_old_is_flagged_stale(run_dir: Path):
    _flight(run_dir, 0)
    _flight(run_dir, 1, time=NOW - 30, phase="optimizer", phase_since=NOW - 31)
    view = read_run(run_dir, now=NOW)
    assert view.status == "running" and not view.ended
    assert [line.stale for line in view.ranks] == [False, True]
    frame = render_frame(run_dir, now=NOW)
    ranks = _rank_lines(frame)
    assert "STALE" in ranks[1] and "STALE" not in ranks[0]
    assert "it may hang" in frame


def test_silent_ranks_with_no_lock_holder_ended_without_a_report(run_dir: Path):
    _flight(run_dir, 0, time=NOW - 60)
    _flight(run_dir, 1, time=NOW - 60)
    view = read_run(run_dir, now=NOW)
    assert view.status == "ended without a report" and view.ended
    assert not any(line.stale for line in view.ranks)  # nothing runs: nothing hangs


def test_fresh_records_with_a_free_lock_ended_without_a_report(run_dir: Path):
    # the launcher and its workers SIGKILLed a moment ago: their last records are fresh,
    # but nothing holds the run directory any more
    with hold_run_dir(run_dir, job_id="killed"):
        pass
    assert is_held(run_dir) is False
    _flight(run_dir, 0)
    _flight(run_dir, 1)
    _metrics(run_dir, [_row(11), _row(12)])
    view = read_run(run_dir, now=NOW)
    assert view.status == "ended without a report" and view.ended
    assert view.eta_s is None and not any(line.stale for line in view.ranks)


def test_a_completed_report_ends_the_run(run_dir: Path):
    _flight(run_dir, 0, status="finished", step=40, time=NOW - 5)
    _flight(run_dir, 1, status="finished", step=40, time=NOW - 5)
    _metrics(run_dir, [_row(40)])
    (run_dir / "report.json").write_text(json.dumps({"status": "completed", "steps": 40}))
    view = read_run(run_dir, now=NOW)
    assert view.status == "completed" and view.ended and view.step == 40
    assert "step 40/40 [####################] 100.0%" in render_frame(run_dir, now=NOW)


def test_an_earlier_runs_report_does_not_end_the_run_holding_the_lock(run_dir: Path):
    (run_dir / "report.json").write_text(json.dumps({"status": "completed"}))
    os.utime(run_dir / "report.json", (time.time() - 3600, time.time() - 3600))
    lock = hold_run_dir(run_dir, job_id="test-top")
    try:
        assert is_held(run_dir) is True
        view = read_run(run_dir)
        assert view.status == "running" and not view.ended
    finally:
        lock.release()
    assert is_held(run_dir) is False
    assert read_run(run_dir).status == "completed"


def test_a_final_report_waits_for_the_ranks_last_records_while_the_lock_is_held(run_dir: Path):
    lock = hold_run_dir(run_dir, job_id="test-top")
    try:
        now = time.time()
        _flight(run_dir, 0, time=now, started=now)  # still writing its last record
        _flight(run_dir, 1, status="finished", time=now, started=now)
        _flight(run_dir, 2, time=now - 3600, started=now - 3600)  # a larger earlier run's
        (run_dir / "report.json").write_text(json.dumps({"status": "completed"}))
        view = read_run(run_dir, now=now)
        assert view.status == "completed" and not view.ended
        assert [line.problem for line in view.ranks] == [None, None, "earlier run"]
        _flight(run_dir, 0, status="finished", time=now, started=now)
        assert read_run(run_dir, now=now).ended
    finally:
        lock.release()


def test_is_held_cannot_tell_without_a_lock_file(tmp_path: Path):
    assert is_held(tmp_path) is None


def test_eta_follows_the_pace_of_the_newest_rows(run_dir: Path):
    _flight(run_dir, 0, step=20)
    rows = [_row(10, time=NOW - 10), _row(20, time=NOW)]  # 1 s a step
    _metrics(run_dir, [_row(30, time=NOW - 500), *rows])  # a resumed run logs steps again
    view = read_run(run_dir, now=NOW)
    assert view.step == 20 and view.eta_s == pytest.approx(20.0)
    assert "ETA 0:20" in render_frame(run_dir, now=NOW)


def test_network_sums_real_interfaces_and_shows_loopback_only_when_it_is_all(run_dir: Path):
    _flight(run_dir, 0)
    (run_dir / "system").mkdir()
    busy = {
        "lo": _iface(9e9, 9e9),
        "eth0": _iface(1 * 2**20, 2**20, 0.25),
        "ib0": _iface(3 * 2**20, 2**20, 0.5),
    }
    gpu = {
        "index": 0,
        "name": "NVIDIA H100",
        "memory_used_bytes": 2**30,
        "memory_total_bytes": 80 * 2**30,
        "utilization_percent": 97.0,
        "temperature_c": 70.0,
        "power_w": 300.0,
    }
    lines = [json.dumps(_sample(busy, [gpu], host="gpu-a"))]
    (run_dir / "system" / "node-0.jsonl").write_text("\n".join(lines) + "\n")
    only_lo = _sample({"lo": _iface(2**20, 2**20)}, host="cpu-b", node=1)
    (run_dir / "system" / "node-1.jsonl").write_text(json.dumps(only_lo) + "\n")
    frame = render_frame(run_dir, now=NOW)
    table = frame.split("\nhost ", 1)[1].splitlines()[1:]
    hosts = {line.split()[0]: line for line in table if not line.startswith(" ")}
    assert "4.0 MiB/s" in hosts["gpu-a"] and "2.0 MiB/s" in hosts["gpu-a"]
    assert "50.0% ib0" in hosts["gpu-a"] and "3.0 GiB / 16.0 GiB" in hosts["gpu-a"]
    assert "lo 1.0 MiB/s" in hosts["cpu-b"]
    assert "gpu 0 NVIDIA H100  util 97%  mem 1.0 GiB / 80.0 GiB  70 C  300 W" in frame


def test_gpu_ranks_show_allocated_and_reserved_memory(run_dir: Path):
    _flight(
        run_dir,
        0,
        memory={"rss_bytes": 1, "cuda_allocated_bytes": 2**30, "cuda_reserved_bytes": 2 * 2**30},
    )
    _flight(run_dir, 1, memory={}, step_time_s=None)
    _metrics(
        run_dir, [_row(12, step_time_s_per_rank=[0.25, 0.5], memory_bytes_per_rank=[1, 5 * 2**20])]
    )
    ranks = _rank_lines(render_frame(run_dir, now=NOW))
    assert "1.0 GiB / 2.0 GiB" in " ".join(ranks[0])
    assert "0.500 s" in " ".join(ranks[1]) and "5.0 MiB" in " ".join(ranks[1])


def test_every_line_fits_the_width(run_dir: Path):
    _flight(run_dir, 0, host="a-very-long-host-name-indeed.example.com", phase="x" * 60)
    _flight(run_dir, 1, time=NOW - 30)
    _metrics(run_dir, [_row(11)])
    (run_dir / "report.json").write_text(
        json.dumps({"status": "failed", "failure": {"summary": "boom " * 60}})
    )
    for width in (100, 60):
        frame = render_frame(run_dir, now=NOW, width=width)
        assert max(len(line) for line in frame.splitlines()) <= width, frame
    assert "failure: boom" in frame


def test_only_the_tail_of_a_large_metrics_file_is_read(tmp_path: Path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(_row(s)) + "\n" for s in range(20_000)))
    rows = tail_rows(path, max_bytes=4096)
    assert 0 < len(rows) < 50 and rows[-1]["step"] == 19_999
    wide = {"step": 1, "own_s_per_rank": [0.1] * 5000}  # one row wider than the window
    path.write_text(json.dumps(wide) + "\n")
    assert tail_rows(path, max_bytes=1024) == [wide]
