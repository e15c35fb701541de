"""A single-node `meshforge train` listens on loopback only (issue 26, "Listeners"): the
elastic agent's rendezvous store, global rank 0's process-group store and gloo, read
from /proc while the run is running."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from helpers import REPO
from listening import is_loopback, listeners

pytestmark = pytest.mark.slow


def test_single_node_run_listens_on_loopback_only(tmp_path):
    run_dir = tmp_path / "run"
    env = {
        k: v
        for k, v in os.environ.items()
        if k != "MESHFORGE_FAULT" and not k.startswith(("PET_", "GLOO_", "NCCL_"))
    }
    env.pop("MESHFORGE_JOB_SECRET", None)
    argv = [sys.executable, "-m", "meshforge", "train", str(REPO / "examples" / "gpt-tiny.yaml"),
            "--nproc", "2", "--run-dir", str(run_dir), "--set", "train.steps=40",
            "--set", "train.eval_every=0", "--set", "checkpoint.every=0",
            "--set", "observe.log_every=5"]  # fmt: skip
    log = (tmp_path / "train.log").open("w")
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    seen: set[tuple[int, str, int]] = set()
    while_training = 0  # snapshots taken once the workers had logged a step
    try:
        deadline = time.monotonic() + 300
        while proc.poll() is None:
            assert time.monotonic() < deadline, "the run did not end within 300 s"
            training = (run_dir / "metrics.jsonl").exists()
            now = listeners(proc.pid)
            seen |= now
            if training and proc.poll() is None:
                while_training += 1
            time.sleep(0.1)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=60)
        log.close()
    output = (tmp_path / "train.log").read_text()
    assert proc.returncode == 0, output[-3000:]
    assert while_training >= 3, f"too few looks at a running job: {while_training}\n{output}"
    owners = {pid for pid, _, _ in seen}
    # the check saw what it checks: the agent's store (the launcher) and, in the workers,
    # rank 0's store and gloo's listeners (at least one in each of two worker processes)
    assert proc.pid in owners, seen
    assert len(owners - {proc.pid}) >= 2, seen
    outside = sorted((pid, addr, port) for pid, addr, port in seen if not is_loopback(addr))
    assert not outside, f"listening outside loopback: {outside}"
