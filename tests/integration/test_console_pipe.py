"""`meshforge train ... | head`: the reader leaves after a few lines; the run goes on."""

from __future__ import annotations

import subprocess
import sys

import pytest

from helpers import REPO, Job

pytestmark = pytest.mark.slow


def test_a_reader_that_leaves_does_not_end_the_run(tmp_path):
    job = Job(tmp_path, {"train": {"steps": 30}, "checkpoint": {"every": 10}})
    argv = [sys.executable, "-m", "meshforge", "train", str(job.config_path), "--nproc", "2",
            "--run-dir", str(job.run_dir)]  # fmt: skip
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        first = proc.stdout.readline()  # as `head -1` does: read a line, then leave
        proc.stdout.close()
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    err = err.decode(errors="replace")
    assert first, err[-3000:]
    assert proc.returncode == 0, err[-3000:]
    assert "Traceback" not in err and "BrokenPipe" not in err, err[-3000:]
    report = job.report
    assert report["status"] == "completed" and report["steps"] == 30
